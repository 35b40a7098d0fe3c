package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"fuseforge.dev/cluster/node/env"
	"fuseforge.dev/cluster/node/gpu"
	"fuseforge.dev/cluster/node/logs"
	"fuseforge.dev/cluster/node/probes"
	"fuseforge.dev/cluster/node/runtime"
	"fuseforge.dev/cluster/node/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// maxBackoff caps the restart backoff (the kubelet's is 5 min; 60 s keeps
// crash loops visible without slowing tests down).
const maxBackoff = 60 * time.Second

var errHalted = errors.New("pod is stopping")

// backoff doubles from 1 s up to max, and starts over after a long run.
type backoff struct {
	d   time.Duration
	max time.Duration
}

func (b *backoff) next(ran time.Duration) time.Duration {
	if ran > 2*b.max {
		b.d = 0
	}
	if b.d == 0 {
		b.d = time.Second
	} else if b.d *= 2; b.d > b.max {
		b.d = b.max
	}
	return b.d
}

// container is one container of a pod: its status and its latest instance.
// Fields after spec are guarded by the runner's mutex.
type container struct {
	r       *podRunner
	spec    v1.Container
	isInit  bool
	sidecar bool
	dir     string

	st        status.Container
	proc      *runtime.Process // latest instance, kept after it exits
	procIdx   int
	rspec     *runtime.Spec
	instances int
	lastErr   string
}

func newContainer(r *podRunner, c *v1.Container, isInit bool) *container {
	sidecar := isInit && c.RestartPolicy != nil && *c.RestartPolicy == v1.ContainerRestartPolicyAlways
	return &container{
		r: r, spec: *c.DeepCopy(), isInit: isInit, sidecar: sidecar,
		dir: filepath.Join(r.dir, "containers", c.Name),
		st: status.Container{
			Name: c.Name, Image: c.Image, ImageID: "host-process://" + c.Image,
			State: status.Waiting("ContainerCreating", ""),
		},
	}
}

// running tells whether the latest instance is alive (caller holds r.mu).
func (c *container) running() bool {
	if c.proc == nil {
		return false
	}
	select {
	case <-c.proc.Done():
		return false
	default:
		return true
	}
}

func (c *container) logPath(idx int) string {
	return filepath.Join(c.dir, "logs", strconv.Itoa(idx)+".log")
}

// loop runs an app or sidecar container, restarting it per restart policy.
func (c *container) loop() {
	bo := &backoff{max: maxBackoff}
	cfgBo := &backoff{max: 10 * time.Second}
	for {
		ex, ran, err := c.runOnce()
		if err == errHalted {
			return
		}
		if err != nil {
			if !c.r.sleep(cfgBo.next(0)) {
				return
			}
			continue
		}
		if c.r.isHalted() || !c.shouldRestart(ex.ExitCode) {
			return
		}
		d := bo.next(ran)
		c.setBackoff(d)
		if !c.r.sleep(d) {
			return
		}
	}
}

func (c *container) shouldRestart(code int32) bool {
	if c.sidecar {
		return true
	}
	switch c.r.podCopy().Spec.RestartPolicy {
	case v1.RestartPolicyNever:
		return false
	case v1.RestartPolicyOnFailure:
		return code != 0
	}
	return true
}

// setBackoff shows the container waiting to be restarted.
func (c *container) setBackoff(d time.Duration) {
	r := c.r
	r.mu.Lock()
	msg := fmt.Sprintf("back-off %s restarting failed container=%s pod=%s_%s(%s)", d, c.spec.Name, r.pod.Name, r.pod.Namespace, r.pod.UID)
	if c.st.State.Terminated != nil {
		c.st.LastState = c.st.State
	}
	c.st.State = status.Waiting("CrashLoopBackOff", msg)
	r.mu.Unlock()
	r.event(c, v1.EventTypeWarning, "BackOff", "Back-off restarting failed container "+c.spec.Name+" in pod "+r.pod.Name)
	r.push()
}

// runOnce starts one instance and waits for it to end. A configuration
// problem (missing ConfigMap key, runAsNonRoot as root ...) leaves the
// container waiting with reason CreateContainerConfigError and returns the error.
func (c *container) runOnce() (*runtime.Exit, time.Duration, error) {
	r := c.r
	spec, newUTS, err := c.buildSpec()
	if err != nil {
		r.mu.Lock()
		c.st.State = status.Waiting("CreateContainerConfigError", err.Error())
		report := err.Error() != c.lastErr
		c.lastErr = err.Error()
		r.mu.Unlock()
		if report {
			r.log.Warn("container config error", "container", c.spec.Name, "err", err)
			r.event(c, v1.EventTypeWarning, "Failed", "Error: "+err.Error())
		}
		r.push()
		return nil, 0, err
	}
	r.mu.Lock()
	if r.halted {
		r.mu.Unlock()
		return nil, 0, errHalted
	}
	c.lastErr = ""
	c.instances++
	idx := c.instances
	if err := os.MkdirAll(filepath.Join(c.dir, "logs"), 0o755); err != nil {
		r.mu.Unlock()
		return nil, 0, err
	}
	_ = os.Remove(c.logPath(idx - 2))
	spec.ID = runtime.NewID()
	prev := c.st.State
	if prev.Waiting != nil && c.st.LastState.Terminated != nil {
		prev = c.st.LastState
	}
	if prev.Terminated != nil {
		c.st.LastState = prev
	}
	c.st.RestartCount = int32(idx - 1)
	c.st.ContainerID = "host-process://" + spec.ID
	proc, err := runtime.Start(spec, c.logPath(idx), newUTS)
	if err != nil {
		now := metav1.Now()
		c.st.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
			ExitCode: runtime.StartErrorExitCode, Reason: "StartError", Message: err.Error(),
			StartedAt: now, FinishedAt: now, ContainerID: c.st.ContainerID,
		}}
		c.st.Ready, c.st.Started = false, false
		r.mu.Unlock()
		r.event(c, v1.EventTypeWarning, "Failed", "Error: "+err.Error())
		r.push()
		return &runtime.Exit{ExitCode: runtime.StartErrorExitCode, StartError: err.Error(), FinishedAt: now.Time}, 0, nil
	}
	c.proc, c.procIdx, c.rspec = proc, idx, spec
	c.st.State = v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: metav1.NewTime(proc.StartedAt)}}
	c.st.Started = c.spec.StartupProbe == nil
	c.st.Ready = c.st.Started && c.spec.ReadinessProbe == nil && (!c.isInit || c.sidecar)
	r.mu.Unlock()
	if idx == 1 {
		r.event(c, v1.EventTypeNormal, "Pulled", fmt.Sprintf("Image %q is not pulled: the container runs in this machine's own environment (host process)", c.spec.Image))
	}
	r.event(c, v1.EventTypeNormal, "Created", "Created container "+c.spec.Name)
	r.event(c, v1.EventTypeNormal, "Started", "Started container "+c.spec.Name)
	r.log.Info("container started", "container", c.spec.Name, "image", c.spec.Image, "pid", proc.Pid, "restarts", idx-1, "argv", spec.Argv)
	r.push()

	ctx, cancel := context.WithCancel(context.Background())
	c.startProbes(ctx, proc, spec)
	if h := c.spec.Lifecycle; h != nil && h.PostStart != nil {
		go func() {
			hctx, hcancel := context.WithTimeout(ctx, 2*time.Minute)
			defer hcancel()
			if ok, msg := c.runHook(hctx, proc, spec, h.PostStart); !ok && ctx.Err() == nil {
				r.event(c, v1.EventTypeWarning, "FailedPostStartHook", msg)
				c.kill(proc, "PostStartHookError")
			}
		}()
	}
	<-proc.Done()
	cancel()
	ex := proc.Exit()
	select {
	case <-time.After(2 * time.Second):
	case <-logsDone(proc):
	}
	msg := c.terminationMessage(ex, c.logPath(idx))
	r.mu.Lock()
	reason := "Completed"
	switch {
	case ex.StartError != "":
		reason = "StartError"
	case ex.ExitCode != 0:
		reason = "Error"
	}
	c.st.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
		ExitCode: ex.ExitCode, Signal: ex.Signal, Reason: reason, Message: msg,
		StartedAt: metav1.NewTime(proc.StartedAt), FinishedAt: metav1.NewTime(ex.FinishedAt), ContainerID: c.st.ContainerID,
	}}
	c.st.Started = false
	// A completed init container counts as ready, as the kubelet reports it.
	c.st.Ready = c.isInit && !c.sidecar && ex.ExitCode == 0
	r.mu.Unlock()
	r.log.Info("container exited", "container", c.spec.Name, "exitCode", ex.ExitCode, "signal", ex.Signal, "reason", reason)
	r.push()
	return &ex, ex.FinishedAt.Sub(proc.StartedAt), nil
}

func logsDone(p *runtime.Process) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		for !p.LogsFlushed() {
			time.Sleep(20 * time.Millisecond)
		}
		close(ch)
	}()
	return ch
}

// terminationMessage is what the container wrote to its termination message
// path, else (on error) the end of its log.
func (c *container) terminationMessage(ex runtime.Exit, logPath string) string {
	if ex.StartError != "" {
		return ex.StartError
	}
	if b, err := os.ReadFile(filepath.Join(c.dir, "termination-log")); err == nil && len(b) > 0 {
		if len(b) > 4096 {
			b = b[:4096]
		}
		return string(b)
	}
	if ex.ExitCode != 0 {
		return logs.TailText(logPath, 80, 2048)
	}
	return ""
}

// kill stops one instance (probe or hook failure) within the container's
// grace period; the restart policy then decides what happens.
func (c *container) kill(proc *runtime.Process, why string) {
	r := c.r
	grace := gracePeriod(r.podCopy())
	if lp := c.spec.LivenessProbe; why == "liveness" && lp != nil && lp.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*lp.TerminationGracePeriodSeconds) * time.Second
	}
	deadline := time.Now().Add(grace)
	c.stopProcess(proc, func() time.Time {
		if d := r.getDeadline(); !d.IsZero() && d.Before(deadline) {
			return d
		}
		return deadline
	}, fmt.Sprintf("Container %s failed %s, will be restarted", c.spec.Name, why))
}

// stopInstance stops the latest instance if it still runs.
func (c *container) stopInstance(deadline func() time.Time, msg string) {
	c.r.mu.Lock()
	proc := c.proc
	c.r.mu.Unlock()
	if proc != nil {
		c.stopProcess(proc, deadline, msg)
	}
}

// stopProcess runs the preStop hook, sends SIGTERM to the container's process
// group, and SIGKILL when the deadline passes.
func (c *container) stopProcess(proc *runtime.Process, deadline func() time.Time, msg string) {
	select {
	case <-proc.Done():
		return
	default:
	}
	r := c.r
	r.event(c, v1.EventTypeNormal, "Killing", msg)
	r.mu.Lock()
	spec := c.rspec
	r.mu.Unlock()
	if h := c.spec.Lifecycle; h != nil && h.PreStop != nil && spec != nil {
		ctx, cancel := context.WithDeadline(context.Background(), deadline())
		if ok, m := c.runHook(ctx, proc, spec, h.PreStop); !ok {
			r.event(c, v1.EventTypeWarning, "FailedPreStopHook", m)
		}
		cancel()
	}
	proc.Signal(syscall.SIGTERM)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-proc.Done():
			return
		case <-t.C:
			if time.Now().After(deadline()) {
				proc.Signal(syscall.SIGKILL)
				select {
				case <-proc.Done():
				case <-time.After(10 * time.Second):
					r.log.Warn("container did not die after SIGKILL", "container", c.spec.Name, "pid", proc.Pid)
				}
				return
			}
		}
	}
}

// runHook runs a lifecycle hook (exec, httpGet, tcpSocket, sleep).
func (c *container) runHook(ctx context.Context, proc *runtime.Process, spec *runtime.Spec, h *v1.LifecycleHandler) (bool, string) {
	if h.Sleep != nil {
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(h.Sleep.Seconds) * time.Second):
		}
		return true, ""
	}
	timeout := time.Until(deadlineOr(ctx, time.Minute))
	ok, msg := probes.Check(ctx, probes.Handler{Exec: h.Exec, HTTPGet: h.HTTPGet, TCPSocket: h.TCPSocket}, &c.spec, timeout, execIn(proc, spec))
	return ok, msg
}

func deadlineOr(ctx context.Context, d time.Duration) time.Time {
	if dl, ok := ctx.Deadline(); ok {
		return dl
	}
	return time.Now().Add(d)
}

func execIn(proc *runtime.Process, spec *runtime.Spec) probes.ExecFunc {
	return func(ctx context.Context, argv []string) ([]byte, int, error) {
		return runtime.Exec(ctx, proc.Pid, spec, argv)
	}
}

// startProbes runs the startup probe, then readiness and liveness, for one
// instance until ctx ends.
func (c *container) startProbes(ctx context.Context, proc *runtime.Process, spec *runtime.Spec) {
	r := c.r
	check := func(p *v1.Probe) func(context.Context, time.Duration) (bool, string) {
		return func(ctx context.Context, timeout time.Duration) (bool, string) {
			return probes.Check(ctx, probes.FromProbe(p), &c.spec, timeout, execIn(proc, spec))
		}
	}
	started := make(chan struct{})
	if p := c.spec.StartupProbe; p != nil {
		go (&probes.Worker{Probe: p, Check: check(p), StopOnSuccess: true, Report: func(ok bool, msg string) {
			if ok {
				r.mu.Lock()
				c.st.Started = true
				c.st.Ready = c.spec.ReadinessProbe == nil && (!c.isInit || c.sidecar)
				r.mu.Unlock()
				r.push()
				close(started)
				return
			}
			r.event(c, v1.EventTypeWarning, "Unhealthy", "Startup probe failed: "+msg)
			go c.kill(proc, "startup probe")
		}}).Run(ctx)
	} else {
		close(started)
	}
	after := func(f func()) {
		go func() {
			select {
			case <-ctx.Done():
			case <-started:
				f()
			}
		}()
	}
	if p := c.spec.ReadinessProbe; p != nil {
		after(func() {
			(&probes.Worker{Probe: p, Check: check(p), Report: func(ok bool, msg string) {
				r.mu.Lock()
				changed := c.st.Ready != ok
				c.st.Ready = ok && ctx.Err() == nil
				r.mu.Unlock()
				if !ok {
					r.event(c, v1.EventTypeWarning, "Unhealthy", "Readiness probe failed: "+msg)
				}
				if changed {
					r.push()
				}
			}}).Run(ctx)
		})
	}
	if p := c.spec.LivenessProbe; p != nil {
		after(func() {
			(&probes.Worker{Probe: p, Check: check(p), Initial: true, Report: func(ok bool, msg string) {
				if !ok && ctx.Err() == nil {
					r.event(c, v1.EventTypeWarning, "Unhealthy", "Liveness probe failed: "+msg)
					go c.kill(proc, "liveness")
				}
			}}).Run(ctx)
		})
	}
}

// buildSpec computes everything about the next instance: environment,
// argv, identity, mounts and the pod's /etc files.
func (c *container) buildSpec() (*runtime.Spec, bool, error) {
	r := c.r
	r.mu.Lock()
	pod := r.pod.DeepCopy()
	vols := r.vols
	asg, hasGPU := r.gpus[c.spec.Name]
	shm := r.shmDir
	r.mu.Unlock()
	cfg := r.p.cfg
	id, err := runtime.ResolveIdentity(pod, &c.spec, runtime.HostFile("/etc/passwd"), runtime.HostFile("/etc/group"))
	if err != nil {
		return nil, false, &env.ConfigError{Msg: err.Error()}
	}
	hostname := runtime.Hostname(pod)
	if pod.Spec.HostNetwork {
		hostname, _ = os.Hostname()
	}
	var base env.Vars
	path := cfg.Node.Path
	if cfg.HostPath != "" {
		if path != "" {
			path += ":"
		}
		path += cfg.HostPath
	}
	base.Set("PATH", path)
	workdir := c.spec.WorkingDir
	imageWorkdir := ""
	if workdir == "" {
		imageWorkdir = cfg.Node.WorkdirFor(c.spec.Image)
		workdir = imageWorkdir
	}
	if imageWorkdir != "" {
		base.Set("HOME", imageWorkdir)
	} else {
		base.Set("HOME", id.Home)
	}
	base.Set("HOSTNAME", hostname)
	for _, kv := range cfg.Node.Env {
		base.Set(kv.Key, kv.Value)
	}
	if pod.Spec.EnableServiceLinks == nil || *pod.Spec.EnableServiceLinks {
		if cfg.Services != nil {
			if svcs, err := cfg.Services.Services(pod.Namespace).List(labels.Everything()); err == nil {
				env.ServiceLinks(svcs, &base)
			}
		}
	}
	port := cfg.APIPort
	base.Set("KUBERNETES_SERVICE_HOST", "127.0.0.1")
	base.Set("KUBERNETES_SERVICE_PORT", port)
	base.Set("KUBERNETES_SERVICE_PORT_HTTPS", port)
	base.Set("KUBERNETES_PORT", "tcp://127.0.0.1:"+port)
	base.Set("KUBERNETES_PORT_"+port+"_TCP", "tcp://127.0.0.1:"+port)
	base.Set("KUBERNETES_PORT_"+port+"_TCP_PROTO", "tcp")
	base.Set("KUBERNETES_PORT_"+port+"_TCP_PORT", port)
	base.Set("KUBERNETES_PORT_"+port+"_TCP_ADDR", "127.0.0.1")
	if hasGPU && gpu.Count(&c.spec) > 0 {
		v := gpu.Visible(asg)
		base.Set("NVIDIA_VISIBLE_DEVICES", v)
		base.Set("CUDA_VISIBLE_DEVICES", v)
	}
	vars, err := env.Container(&c.spec, env.Context{Pod: pod, Allocatable: cfg.Allocatable, Sources: r.p.mat.Sources, Base: base})
	if err != nil {
		return nil, false, err
	}
	argv, err := env.Argv(&c.spec, vars, cfg.Node.EntrypointFor(c.spec.Image))
	if err != nil {
		return nil, false, err
	}
	var mounts []runtime.Mount
	for _, vm := range c.spec.VolumeMounts {
		v, ok := vols[vm.Name]
		if !ok {
			return nil, false, &env.ConfigError{Msg: fmt.Sprintf("volume %q of mount %s is not defined in the pod", vm.Name, vm.MountPath)}
		}
		src := v.Path
		sub := vm.SubPath
		if vm.SubPathExpr != "" {
			sub = env.Expand(vm.SubPathExpr, vars.Get)
		}
		if sub != "" {
			clean := filepath.Clean(sub)
			if filepath.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
				return nil, false, &env.ConfigError{Msg: fmt.Sprintf("subPath %q must stay inside volume %q", sub, vm.Name)}
			}
			src = filepath.Join(src, clean)
			if _, err := os.Lstat(src); os.IsNotExist(err) {
				if err := os.MkdirAll(src, 0o755); err != nil {
					return nil, false, &env.ConfigError{Msg: fmt.Sprintf("subPath %q of volume %q: %v", sub, vm.Name, err)}
				}
			}
		}
		mounts = append(mounts, runtime.Mount{Source: src, Target: vm.MountPath, ReadOnly: vm.ReadOnly || v.ReadOnlyKind})
	}
	if tp := c.spec.TerminationMessagePath; tp != "" {
		f := filepath.Join(c.dir, "termination-log")
		if err := os.MkdirAll(c.dir, 0o755); err != nil {
			return nil, false, err
		}
		if err := os.WriteFile(f, nil, 0o666); err != nil {
			return nil, false, err
		}
		_ = os.Chmod(f, 0o666)
		mounts = append(mounts, runtime.Mount{Source: f, Target: tp})
	}
	sort.SliceStable(mounts, func(i, j int) bool {
		return strings.Count(filepath.Clean(mounts[i].Target), "/") < strings.Count(filepath.Clean(mounts[j].Target), "/")
	})
	domain := cfg.Node.ClusterDomain
	files := []runtime.File{
		{Path: "/etc/hosts", Content: runtime.HostsFile(pod, domain, runtime.HostFile("/etc/hosts")), Mode: 0o644},
		{Path: "/etc/resolv.conf", Content: runtime.ResolvConf(pod, cfg.Node.DNSIP.String(), domain, runtime.HostFile("/etc/resolv.conf")), Mode: 0o644},
		{Path: "/etc/hostname", Content: hostname + "\n", Mode: 0o644},
	}
	spec := &runtime.Spec{
		StateDir:    cfg.Node.StateDir,
		Dir:         c.dir,
		Hostname:    hostname,
		SetHostname: !pod.Spec.HostNetwork,
		ShmSource:   shm,
		Mounts:      mounts,
		Files:       files,
		WorkingDir:  workdir,
		OwnedDir:    imageWorkdir,
		Traversable: cfg.Node.Traversable,
		Argv:        argv,
		Env:         vars.Environ(),
		UID:         id.UID,
		GID:         id.GID,
		Groups:      id.Groups,
	}
	if sc := c.spec.SecurityContext; sc != nil {
		spec.ReadOnlyRoot = sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem
		spec.NoNewPrivs = sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation
	}
	return spec, !pod.Spec.HostNetwork, nil
}
