package logs

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// writeLog writes records with a controllable clock.
func writeLog(t *testing.T, path string, times []time.Time, lines []string, stream string) *Writer {
	t.Helper()
	w, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	i := 0
	w.now = func() time.Time { tm := times[i]; i++; return tm }
	for _, l := range lines {
		w.WriteLine(stream, l)
	}
	return w
}

func readAll(t *testing.T, path string, o Options) string {
	t.Helper()
	var b bytes.Buffer
	if err := Read(context.Background(), path, o, func() bool { return true }, &b); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestReadOptions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "0.log")
	base := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	times := []time.Time{base, base.Add(time.Second), base.Add(2 * time.Second), base.Add(3 * time.Second)}
	w := writeLog(t, path, times, []string{"one", "two", "three", "four"}, "stdout")
	w.Close()
	if got := readAll(t, path, Options{Tail: -1}); got != "one\ntwo\nthree\nfour\n" {
		t.Errorf("all: %q", got)
	}
	if got := readAll(t, path, Options{Tail: 2}); got != "three\nfour\n" {
		t.Errorf("tail 2: %q", got)
	}
	if got := readAll(t, path, Options{Tail: 10}); got != "one\ntwo\nthree\nfour\n" {
		t.Errorf("tail 10: %q", got)
	}
	if got := readAll(t, path, Options{Tail: 0}); got != "" {
		t.Errorf("tail 0: %q", got)
	}
	if got := readAll(t, path, Options{Tail: 1, Timestamps: true}); got != "2026-01-02T03:04:08.000000006Z four\n" {
		t.Errorf("timestamps: %q", got)
	}
	if got := readAll(t, path, Options{Tail: -1, Since: base.Add(1500 * time.Millisecond)}); got != "three\nfour\n" {
		t.Errorf("since: %q", got)
	}
	if got := readAll(t, path, Options{Tail: -1, LimitBytes: 6}); got != "one\ntw" {
		t.Errorf("limitBytes: %q", got)
	}
}

func TestPumpPartialLines(t *testing.T) {
	path := filepath.Join(t.TempDir(), "0.log")
	w, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("x", maxLine+10)
	w.Pump(strings.NewReader("a\n"+long+"\nno-newline"), "stderr")
	w.Close()
	want := "a\n" + long + "\nno-newline"
	if got := readAll(t, path, Options{Tail: -1}); got != want {
		t.Errorf("long line/partial: got %d bytes, want %d", len(got), len(want))
	}
	// A long line split into records still counts as one line for tail.
	if got := readAll(t, path, Options{Tail: 2}); got != long+"\nno-newline" {
		t.Errorf("tail across partial records: %d bytes", len(got))
	}
	if got := TailText(path, 1, 5); got != "wline" {
		t.Errorf("TailText: %q", got)
	}
}

func TestFollow(t *testing.T) {
	path := filepath.Join(t.TempDir(), "0.log")
	w, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w.WriteLine("stdout", "first")
	var finished atomic.Bool
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := Read(context.Background(), path, Options{Tail: -1, Follow: true}, finished.Load, pw)
		pw.Close()
		done <- err
	}()
	buf := make([]byte, 64)
	n, _ := io.ReadAtLeast(pr, buf, len("first\n"))
	if string(buf[:n]) != "first\n" {
		t.Fatalf("got %q", buf[:n])
	}
	w.WriteLine("stdout", "second")
	n, _ = io.ReadAtLeast(pr, buf, len("second\n"))
	if string(buf[:n]) != "second\n" {
		t.Fatalf("followed %q", buf[:n])
	}
	w.WriteLine("stdout", "last")
	finished.Store(true)
	rest, _ := io.ReadAll(pr)
	if string(rest) != "last\n" {
		t.Errorf("after finish: %q", rest)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Error(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("follow did not end when the container finished")
	}
}
