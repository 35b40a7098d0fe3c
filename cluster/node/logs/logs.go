// Package logs stores container output in the CRI log format
// ("<RFC3339Nano time> <stream> <F|P> <text>" per line) so that `kubectl logs`
// can be served with timestamps, tail, since and follow from the file alone.
package logs

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"sync"
	"time"
)

// TimeFormat is the fixed-width timestamp of a record (what --timestamps shows).
const TimeFormat = "2006-01-02T15:04:05.000000000Z07:00"

// maxLine splits very long lines into partial (P) records.
const maxLine = 16 * 1024

// Writer appends records from a container's stdout and stderr to one file.
type Writer struct {
	mu  sync.Mutex
	f   *os.File
	now func() time.Time
}

// Create opens (truncating) the log file of one container instance.
func Create(path string) (*Writer, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return nil, err
	}
	return &Writer{f: f, now: time.Now}, nil
}

// Pump copies r (a pipe) into the log as stream ("stdout" or "stderr") until EOF.
func (w *Writer) Pump(r io.Reader, stream string) {
	br := bufio.NewReaderSize(r, maxLine)
	for {
		line, err := br.ReadSlice('\n')
		switch {
		case err == nil:
			w.record(stream, 'F', line[:len(line)-1])
		case errors.Is(err, bufio.ErrBufferFull):
			w.record(stream, 'P', line)
		default:
			if len(line) > 0 {
				w.record(stream, 'P', line)
			}
			return
		}
	}
}

// WriteLine adds a full line of node-generated text (e.g. why a start failed).
func (w *Writer) WriteLine(stream, text string) {
	w.record(stream, 'F', []byte(text))
}

func (w *Writer) record(stream string, tag byte, text []byte) {
	var b bytes.Buffer
	b.Grow(len(text) + 48)
	b.WriteString(w.now().UTC().Format(TimeFormat))
	b.WriteByte(' ')
	b.WriteString(stream)
	b.WriteByte(' ')
	b.WriteByte(tag)
	b.WriteByte(' ')
	b.Write(text)
	b.WriteByte('\n')
	w.mu.Lock()
	defer w.mu.Unlock()
	_, _ = w.f.Write(b.Bytes())
}

// Close closes the file.
func (w *Writer) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.f.Close()
}

// Options select what to read, as the kubelet's log options do.
type Options struct {
	// Tail keeps only the last Tail lines; negative means all.
	Tail       int
	LimitBytes int64
	Timestamps bool
	Since      time.Time
	Follow     bool
}

// record is one parsed line of the file.
type record struct {
	ts      time.Time
	tsText  []byte
	partial bool
	text    []byte
}

func parse(line []byte) (record, bool) {
	// line excludes the trailing newline.
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 < 0 {
		return record{}, false
	}
	rest := line[sp1+1:]
	sp2 := bytes.IndexByte(rest, ' ')
	if sp2 < 0 || len(rest) < sp2+3 {
		return record{}, false
	}
	tag := rest[sp2+1]
	ts, err := time.Parse(time.RFC3339Nano, string(line[:sp1]))
	if err != nil {
		return record{}, false
	}
	return record{ts: ts, tsText: line[:sp1], partial: tag == 'P', text: rest[sp2+3:]}, true
}

var errLimit = errors.New("limit reached")

type limitWriter struct {
	w    io.Writer
	left int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.left <= 0 {
		return 0, errLimit
	}
	if int64(len(p)) > l.left {
		n, err := l.w.Write(p[:l.left])
		l.left -= int64(n)
		if err == nil {
			err = errLimit
		}
		return n, err
	}
	n, err := l.w.Write(p)
	l.left -= int64(n)
	return n, err
}

// Read writes the log at path to w as `kubectl logs` shows it. With Follow it
// keeps waiting for new records until finished() reports that the container
// instance has exited (and its output is flushed) or ctx ends.
func Read(ctx context.Context, path string, opts Options, finished func() bool, w io.Writer) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if opts.LimitBytes > 0 {
		w = &limitWriter{w: w, left: opts.LimitBytes}
	}
	start := int64(0)
	if opts.Tail >= 0 {
		if start, err = tailOffset(f, opts.Tail); err != nil {
			return err
		}
	}
	if _, err := f.Seek(start, io.SeekStart); err != nil {
		return err
	}
	br := bufio.NewReaderSize(f, 64*1024)
	var pending []byte
	lineStart := true
	for {
		chunk, err := br.ReadBytes('\n')
		pending = append(pending, chunk...)
		if err == nil {
			line := pending[:len(pending)-1]
			if rec, ok := parse(line); ok && (opts.Since.IsZero() || !rec.ts.Before(opts.Since)) {
				var out []byte
				if opts.Timestamps && lineStart {
					out = append(append(out, rec.tsText...), ' ')
				}
				out = append(out, rec.text...)
				if !rec.partial {
					out = append(out, '\n')
				}
				if _, werr := w.Write(out); werr != nil {
					if errors.Is(werr, errLimit) {
						return nil
					}
					return werr
				}
				if fl, ok := w.(interface{ Flush() }); ok {
					fl.Flush()
				}
				lineStart = !rec.partial
			}
			pending = pending[:0]
			continue
		}
		if !errors.Is(err, io.EOF) {
			return err
		}
		if !opts.Follow {
			return nil
		}
		if finished() {
			// One more pass: the writer may have added lines since EOF.
			rest, _ := io.ReadAll(br)
			if len(rest) == 0 {
				return nil
			}
			br.Reset(io.MultiReader(bytes.NewReader(rest), f))
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(150 * time.Millisecond):
		}
	}
}

// tailOffset finds where the last n logical lines begin (a logical line is
// any run of P records closed by an F record).
func tailOffset(f *os.File, n int) (int64, error) {
	if n == 0 {
		st, err := f.Stat()
		if err != nil {
			return 0, err
		}
		return st.Size(), nil
	}
	ring := make([]int64, n)
	count := 0
	br := bufio.NewReaderSize(f, 64*1024)
	var off int64
	lineStart := true
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 && err == nil {
			if lineStart {
				ring[count%n] = off
				count++
			}
			rec, ok := parse(line[:len(line)-1])
			lineStart = !ok || !rec.partial
		}
		off += int64(len(line))
		if err != nil {
			break
		}
	}
	if count <= n {
		return 0, nil
	}
	return ring[count%n], nil
}

// TailText returns the last lines of a log (at most maxBytes), without
// timestamps: what a failed container's termination message shows.
func TailText(path string, lines int, maxBytes int) string {
	var b bytes.Buffer
	_ = Read(context.Background(), path, Options{Tail: lines}, func() bool { return true }, &b)
	out := b.Bytes()
	if len(out) > maxBytes {
		out = out[len(out)-maxBytes:]
	}
	return string(out)
}
