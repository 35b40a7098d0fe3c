//go:build linux

package runtime

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"fuseforge.dev/cluster/node/logs"
)

// NewID returns a container ID (64 hex digits, like other runtimes' IDs).
func NewID() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Exit describes how a container instance ended.
type Exit struct {
	ExitCode   int32
	Signal     int32
	StartError string
	FinishedAt time.Time
}

// Process is a running container instance (its process group).
type Process struct {
	Pid       int
	StartedAt time.Time
	done      chan struct{}
	logsDone  chan struct{}
	exit      Exit
}

// Done is closed when the container's main process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exit is valid after Done.
func (p *Process) Exit() Exit { return p.exit }

// LogsFlushed tells whether the instance's output is completely in its log.
func (p *Process) LogsFlushed() bool {
	select {
	case <-p.logsDone:
		return true
	default:
		return false
	}
}

// Signal sends sig to the container's whole process group.
func (p *Process) Signal(sig syscall.Signal) {
	_ = syscall.Kill(-p.Pid, sig)
}

// Start launches spec as `<self> run-container` in new namespaces. Output goes
// to a fresh log at logPath. newUTS gives the container its own hostname.
func Start(spec *Spec, logPath string, newUTS bool) (*Process, error) {
	for _, d := range []string{"upper", "work", "devupper", "devwork"} {
		// A restarted container gets a fresh writable layer, as with images.
		if err := os.RemoveAll(filepath.Join(spec.Dir, d)); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{"root", "upper", "work", "devupper", "devwork"} {
		if err := os.MkdirAll(filepath.Join(spec.Dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	spec.ParentPID = os.Getpid()
	specPath := filepath.Join(spec.Dir, "spec.json")
	if err := spec.Write(specPath); err != nil {
		return nil, err
	}
	lw, err := logs.Create(logPath)
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		lw.Close()
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		lw.Close()
		outR.Close()
		outW.Close()
		return nil, err
	}
	epR, epW, err := os.Pipe()
	if err != nil {
		lw.Close()
		for _, f := range []*os.File{outR, outW, errR, errW} {
			f.Close()
		}
		return nil, err
	}
	cmd := exec.Command("/proc/self/exe", SubcommandName, specPath)
	cmd.Env = []string{"FUSEFORGE_CONTAINER_ID=" + spec.ID}
	cmd.Stdout, cmd.Stderr = outW, errW
	cmd.ExtraFiles = []*os.File{epW}
	flags := uintptr(syscall.CLONE_NEWNS)
	if newUTS {
		flags |= syscall.CLONE_NEWUTS
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:    true,
		Pdeathsig:  syscall.SIGKILL,
		Cloneflags: flags,
	}
	startErr := cmd.Start()
	outW.Close()
	errW.Close()
	epW.Close()
	if startErr != nil {
		outR.Close()
		errR.Close()
		epR.Close()
		lw.Close()
		return nil, startErr
	}
	p := &Process{Pid: cmd.Process.Pid, StartedAt: time.Now(), done: make(chan struct{}), logsDone: make(chan struct{})}
	_ = os.WriteFile(filepath.Join(spec.Dir, "pid"), []byte(fmt.Sprintf("%d %d\n", p.Pid, procStartTime(p.Pid))), 0o644)
	var pumps sync.WaitGroup
	pumps.Add(2)
	go func() { defer pumps.Done(); lw.Pump(outR, "stdout"); outR.Close() }()
	go func() { defer pumps.Done(); lw.Pump(errR, "stderr"); errR.Close() }()
	pumpsDone := make(chan struct{})
	go func() { pumps.Wait(); close(pumpsDone) }()
	go func() {
		msg, _ := io.ReadAll(io.LimitReader(epR, 4096))
		epR.Close()
		_ = cmd.Wait()
		// The container ends with its main process: the rest of its group goes too.
		_ = syscall.Kill(-p.Pid, syscall.SIGKILL)
		ex := Exit{FinishedAt: time.Now(), StartError: strings.TrimSpace(string(msg))}
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
			if ws.Signaled() {
				ex.Signal = int32(ws.Signal())
				ex.ExitCode = 128 + int32(ws.Signal())
			} else {
				ex.ExitCode = int32(ws.ExitStatus())
			}
		}
		if ex.StartError != "" {
			ex.ExitCode = StartErrorExitCode
		}
		p.exit = ex
		close(p.done)
		// Output still buffered in the pipes is drained first; a stray process
		// that escaped the group must not hold `kubectl logs -f` open forever.
		select {
		case <-pumpsDone:
			lw.Close()
		case <-time.After(2 * time.Second):
		}
		close(p.logsDone)
	}()
	return p, nil
}

// procStartTime reads a process's start time (clock ticks since boot) so a
// recorded pid is only ever killed if it is still the same process.
func procStartTime(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		f := strings.Fields(s[i+1:])
		if len(f) > 19 {
			v, _ := strconv.ParseUint(f[19], 10, 64)
			return v
		}
	}
	return 0
}

// KillRecorded kills the process group recorded in a container directory by
// an earlier run of the node (one that crashed), if it is still alive.
func KillRecorded(dir string) {
	b, err := os.ReadFile(filepath.Join(dir, "pid"))
	if err != nil {
		return
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscanf(string(b), "%d %d", &pid, &start); err != nil || pid <= 1 {
		return
	}
	if start != 0 && procStartTime(pid) == start {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	}
}

// Exec runs argv inside a running container (its mount and UTS namespaces,
// its root, working directory and user) through nsenter(1): a Go program
// cannot join a mount namespace itself once it has threads.
func Exec(ctx context.Context, pid int, spec *Spec, argv []string) ([]byte, int, error) {
	args := []string{
		"--target", strconv.Itoa(pid), "--mount", "--uts", "--root", "--wdns=" + orRoot(spec.WorkingDir),
		"--setgid", strconv.Itoa(int(spec.GID)), "--setuid", strconv.Itoa(int(spec.UID)), "--",
	}
	args = append(args, argv...)
	cmd := exec.CommandContext(ctx, "nsenter", args...)
	cmd.Env = spec.Env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		return out, -1, fmt.Errorf("command timed out")
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return out, ee.ExitCode(), nil
	}
	if err != nil {
		return out, -1, err
	}
	return out, 0, nil
}

func orRoot(s string) string {
	if s == "" {
		return "/"
	}
	return s
}
