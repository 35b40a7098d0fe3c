//go:build linux

package runtime

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// StartErrorExitCode is the exit code of a container that could not be
// started (the child failed before exec), as containerd reports it.
const StartErrorExitCode = 128

// ChildMain is `node run-container SPEC`: it runs in the container's fresh
// mount (and UTS) namespace, builds the root and execs the command. It never
// returns. Failures before exec are written to fd 3, which the node reads
// (a successful exec closes it: it is close-on-exec).
func ChildMain(specPath string) {
	// Thread-scoped settings (no_new_privs, the parent-death signal) must be
	// made on the thread that finally calls exec.
	goruntime.LockOSThread()
	syscall.CloseOnExec(3)
	errPipe := os.NewFile(3, "start-error")
	fail := func(format string, a ...any) {
		msg := fmt.Sprintf(format, a...)
		if errPipe != nil {
			_, _ = errPipe.WriteString(msg)
		}
		fmt.Fprintln(os.Stderr, "host-process runtime: "+msg)
		os.Exit(StartErrorExitCode)
	}
	spec, err := ReadSpec(specPath)
	if err != nil {
		fail("reading container spec: %v", err)
	}
	if err := buildRoot(spec); err != nil {
		fail("%v", err)
	}
	if spec.SetHostname && spec.Hostname != "" {
		if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
			fail("sethostname: %v", err)
		}
	}
	wd := spec.WorkingDir
	if wd == "" {
		wd = "/"
	}
	_ = os.MkdirAll(wd, 0o755)
	if err := os.Chdir(wd); err != nil {
		fail("working directory %s: %v", wd, err)
	}
	if spec.ReadOnlyRoot {
		if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
			fail("read-only root filesystem: %v", err)
		}
	}
	exe, err := lookPath(spec.Argv[0], spec.Env)
	if err != nil {
		fail("%v", err)
	}
	if err := dropPrivileges(spec); err != nil {
		fail("%v", err)
	}
	if spec.NoNewPrivs {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			fail("no_new_privs: %v", err)
		}
	}
	if err := syscall.Exec(exe, spec.Argv, spec.Env); err != nil {
		fail("exec %q: %v", spec.Argv[0], err)
	}
}

// buildRoot mounts the overlay root and everything in it, then chroots.
func buildRoot(spec *Spec) error {
	// Nothing we mount may propagate back to the node or the host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	root := filepath.Join(spec.Dir, "root")
	opts := fmt.Sprintf("lowerdir=/,upperdir=%s,workdir=%s", filepath.Join(spec.Dir, "upper"), filepath.Join(spec.Dir, "work"))
	if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
		return fmt.Errorf("overlay root (%s): %w", opts, err)
	}
	mps, err := mountPoints()
	if err != nil {
		return err
	}
	// /dev gets its own overlay: device nodes work through it, while files a
	// container creates there (/dev/termination-log) stay out of the host's /dev.
	if contains(mps, "/dev") {
		o := fmt.Sprintf("lowerdir=/dev,upperdir=%s,workdir=%s", filepath.Join(spec.Dir, "devupper"), filepath.Join(spec.Dir, "devwork"))
		if err := unix.Mount("overlay", root+"/dev", "overlay", 0, o); err != nil {
			return fmt.Errorf("overlay /dev: %w", err)
		}
	}
	// Every other host mount (/proc, /sys, /dev/pts, /dev/shm, separate /tmp
	// or /home filesystems ...) is bound as it is: overlayfs does not cross
	// mount points. The node's own mounts under the state dir stay out.
	var bound []string
	for _, mp := range mps {
		if mp == "/" || mp == "/dev" || under(mp, spec.StateDir) || coveredBy(mp, bound) {
			continue
		}
		st, err := os.Stat(mp)
		if err != nil || !st.IsDir() {
			// File mounts (a runtime's /etc/hosts) are skipped: we write our own.
			continue
		}
		target := root + mp
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("mount point %s: %w", target, err)
		}
		if err := unix.Mount(mp, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("binding %s: %w", mp, err)
		}
		bound = append(bound, mp)
	}
	// Hide the state dir: other pods' secrets live there.
	hidden := root + spec.StateDir
	if err := os.MkdirAll(hidden, 0o755); err == nil {
		if err := unix.Mount("tmpfs", hidden, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k,mode=755"); err != nil {
			return fmt.Errorf("hiding state dir: %w", err)
		}
	}
	// Sources are host paths: hold them open across the chroot.
	type src struct {
		fd  int
		dir bool
	}
	open := func(p string) (src, error) {
		fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return src{}, fmt.Errorf("volume source %s: %w", p, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return src{}, err
		}
		return src{fd: fd, dir: st.Mode&unix.S_IFMT == unix.S_IFDIR}, nil
	}
	var shm src
	haveShm := spec.ShmSource != ""
	if haveShm {
		if shm, err = open(spec.ShmSource); err != nil {
			return err
		}
	}
	srcs := make([]src, len(spec.Mounts))
	for i, m := range spec.Mounts {
		if srcs[i], err = open(m.Source); err != nil {
			return err
		}
	}
	if err := unix.Chroot(root); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	for _, d := range spec.Traversable {
		if st, err := os.Stat(d); err == nil && st.IsDir() && st.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(d, st.Mode().Perm()|0o001); err != nil {
				return fmt.Errorf("making %s traversable: %w", d, err)
			}
		}
	}
	if spec.OwnedDir != "" {
		if err := os.MkdirAll(spec.OwnedDir, 0o755); err != nil {
			return fmt.Errorf("workdir %s: %w", spec.OwnedDir, err)
		}
		if err := os.Lchown(spec.OwnedDir, int(spec.UID), int(spec.GID)); err != nil {
			return fmt.Errorf("workdir %s: %w", spec.OwnedDir, err)
		}
	}
	for _, f := range spec.Files {
		_ = os.Remove(f.Path) // a symlink (/etc/resolv.conf) must not be written through
		if err := os.MkdirAll(filepath.Dir(f.Path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(f.Path, []byte(f.Content), os.FileMode(f.Mode)); err != nil {
			return fmt.Errorf("writing %s: %w", f.Path, err)
		}
	}
	bind := func(s src, target string, ro bool) error {
		if s.dir {
			if err := os.MkdirAll(target, 0o755); err != nil {
				return fmt.Errorf("mount path %s: %w", target, err)
			}
		} else {
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return fmt.Errorf("mount path %s: %w", target, err)
			}
			if _, err := os.Stat(target); os.IsNotExist(err) {
				f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY, 0o644)
				if err != nil {
					return fmt.Errorf("mount path %s: %w", target, err)
				}
				f.Close()
			}
		}
		if err := unix.Mount("/proc/self/fd/"+strconv.Itoa(s.fd), target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("mounting at %s: %w", target, err)
		}
		if ro {
			if err := unix.Mount("", target, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
				return fmt.Errorf("read-only %s: %w", target, err)
			}
		}
		return nil
	}
	if haveShm {
		if err := bind(shm, "/dev/shm", false); err != nil {
			return err
		}
	}
	for i, m := range spec.Mounts {
		if err := bind(srcs[i], m.Target, m.ReadOnly); err != nil {
			return err
		}
	}
	return nil
}

func dropPrivileges(spec *Spec) error {
	groups := make([]int, len(spec.Groups))
	for i, g := range spec.Groups {
		groups[i] = int(g)
	}
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setgid(int(spec.GID)); err != nil {
		return fmt.Errorf("setgid %d: %w", spec.GID, err)
	}
	if err := syscall.Setuid(int(spec.UID)); err != nil {
		return fmt.Errorf("setuid %d: %w", spec.UID, err)
	}
	// A credential change clears the parent-death signal: arm it again, and
	// give up if the node is already gone.
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0, 0, 0); err != nil {
		return fmt.Errorf("pdeathsig: %w", err)
	}
	if os.Getppid() != spec.ParentPID {
		return fmt.Errorf("node exited during container start")
	}
	return nil
}

// lookPath finds argv0 in the container's PATH (we are already in its root).
func lookPath(argv0 string, env []string) (string, error) {
	if strings.Contains(argv0, "/") {
		if err := executable(argv0); err != nil {
			return "", fmt.Errorf("exec: %q: %v", argv0, err)
		}
		return argv0, nil
	}
	path := ""
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			path = e[5:]
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, argv0)
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("exec: %q: executable file not found in $PATH", argv0)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("permission denied")
	}
	return nil
}

// mountPoints lists the mount points of this namespace, parents first.
func mountPoints() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	seen := map[string]bool{}
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeOctal(fields[4])
		if !seen[mp] {
			seen[mp] = true
			out = append(out, mp)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return depth(out[i]) < depth(out[j]) })
	return out, sc.Err()
}

func depth(p string) int {
	if p == "/" {
		return 0
	}
	return strings.Count(p, "/")
}

// unescapeOctal decodes mountinfo's \040-style escapes.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir+"/")
}

func coveredBy(p string, bound []string) bool {
	for _, b := range bound {
		if under(p, b) {
			return true
		}
	}
	return false
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
