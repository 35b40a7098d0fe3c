package provider

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"fuseforge.dev/cluster/node/gpu"
	"fuseforge.dev/cluster/node/status"
	"fuseforge.dev/cluster/node/volumes"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// shmSize is a pod's /dev/shm, as containerd gives it (an emptyDir with
// medium Memory mounted at /dev/shm replaces it).
const shmSize = 64 << 20

// podRunner owns one pod for its whole life on the node: volumes, init
// containers in order, app containers, termination and cleanup.
type podRunner struct {
	p   *Provider
	key string
	dir string
	log *slog.Logger

	mu       sync.Mutex
	pod      *v1.Pod
	view     status.Pod
	last     v1.PodStatus
	init     []*container
	app      []*container
	vols     map[string]*volumes.Volume
	gpus     gpu.Assignment
	shmDir   string
	tmpfs    []string
	deadline time.Time // when SIGKILL replaces SIGTERM, once terminating
	halted   bool
	deleted  bool
	released bool

	haltCh     chan struct{} // closed: no container may start or restart
	haltOnce   sync.Once
	stopCh     chan struct{} // closed: stop the pod's containers
	stopOnce   sync.Once
	removeCh   chan struct{} // closed: the pod leaves the node
	removeOnce sync.Once
	sidecars   sync.WaitGroup
	pushMu     sync.Mutex
	done       chan struct{}
}

func newRunner(p *Provider, pod *v1.Pod) *podRunner {
	r := &podRunner{
		p:        p,
		key:      key(pod.Namespace, pod.Name),
		dir:      filepath.Join(p.podsDir, string(pod.UID)),
		log:      p.cfg.Log.With("pod", key(pod.Namespace, pod.Name)),
		pod:      pod,
		last:     *pod.Status.DeepCopy(),
		haltCh:   make(chan struct{}),
		stopCh:   make(chan struct{}),
		removeCh: make(chan struct{}),
		done:     make(chan struct{}),
	}
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		r.init = append(r.init, newContainer(r, c, true))
	}
	for i := range pod.Spec.Containers {
		r.app = append(r.app, newContainer(r, &pod.Spec.Containers[i], false))
	}
	return r
}

func (r *podRunner) uid() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return string(r.pod.UID)
}

func (r *podRunner) update(pod *v1.Pod) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pod.Status = r.pod.Status
	r.pod = pod
}

func (r *podRunner) podCopy() *v1.Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pod.DeepCopy()
}

// snapshot is the pod with the last status the node computed.
func (r *podRunner) snapshot() *v1.Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.pod.DeepCopy()
	out.Status = *r.last.DeepCopy()
	return out
}

func (r *podRunner) setDeadline(grace time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d := time.Now().Add(grace)
	if r.deadline.IsZero() || d.Before(r.deadline) {
		r.deadline = d
	}
}

func (r *podRunner) getDeadline() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.deadline
}

func (r *podRunner) stop()   { r.stopOnce.Do(func() { close(r.stopCh) }) }
func (r *podRunner) remove() { r.removeOnce.Do(func() { close(r.removeCh) }) }

// delete is an API deletion: stop within grace, then remove the pod.
func (r *podRunner) delete(grace time.Duration) {
	r.setDeadline(grace)
	r.mu.Lock()
	r.deleted = true
	r.view.Deleting = true
	r.mu.Unlock()
	r.stop()
	r.remove()
}

// shutdownNode stops the pod because the node is going away.
func (r *podRunner) shutdownNode(grace time.Duration) {
	r.setDeadline(grace)
	r.mu.Lock()
	if ph := r.last.Phase; ph != v1.PodSucceeded && ph != v1.PodFailed && !r.view.Failed {
		r.view.Failed, r.view.Reason, r.view.Message = true, "NodeShutdown", "Pod was terminated in response to the node shutting down"
	}
	r.mu.Unlock()
	r.stop()
	r.remove()
}

// failStop fails the pod (reason, message) and stops what runs.
func (r *podRunner) failStop(reason, msg string) {
	r.mu.Lock()
	if !r.view.Failed {
		r.view.Failed, r.view.Reason, r.view.Message = true, reason, msg
	}
	grace := gracePeriod(r.pod)
	r.mu.Unlock()
	r.setDeadline(grace)
	r.stop()
}

func (r *podRunner) isHalted() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.halted
}

// sleep waits d unless the pod is halted first (false).
func (r *podRunner) sleep(d time.Duration) bool {
	select {
	case <-r.haltCh:
		return false
	case <-time.After(d):
		return true
	}
}

func (r *podRunner) run() {
	defer close(r.done)
	go func() {
		select {
		case <-r.stopCh:
			r.haltAll()
		case <-r.done:
		}
	}()
	r.mu.Lock()
	now := metav1.Now()
	r.view.StartTime = &now
	var images []string
	for _, c := range append(append([]*container{}, r.init...), r.app...) {
		c.st.State = status.Waiting("PodInitializing", "")
		if !c.isInit && len(r.init) == 0 {
			c.st.State = status.Waiting("ContainerCreating", "")
		}
		images = append(images, c.spec.Name+"="+c.spec.Image)
	}
	r.mu.Unlock()
	r.log.Info("pod bound to this node: running its containers as host processes", "uid", r.uid(), "images", images)
	r.push()
	go r.watchDeadline()
	if r.prepare() && r.runInits() {
		r.runApps()
	}
	r.haltAll()
	r.sidecars.Wait()
	r.finalize()
	r.push()
	r.log.Info("pod finished", "phase", r.snapshot().Status.Phase)
	<-r.removeCh
	r.release()
	if err := os.RemoveAll(r.dir); err != nil {
		r.log.Warn("removing pod directory", "err", err)
	}
	r.mu.Lock()
	deleted := r.deleted
	r.mu.Unlock()
	final := r.snapshot()
	r.p.forget(r)
	if deleted {
		r.p.deleteFromAPI(final)
	}
	r.log.Info("pod removed from the node")
}

// prepare materialises volumes and the pod's /dev/shm. Volumes that only
// miss a ConfigMap or Secret for now are retried, as the kubelet does.
func (r *podRunner) prepare() bool {
	pod := r.podCopy()
	asg, err := r.p.gpus.Allocate(r.key, pod)
	if err != nil {
		r.failStop("UnexpectedAdmissionError", err.Error())
		return false
	}
	r.mu.Lock()
	r.gpus = asg
	r.mu.Unlock()
	volDir := filepath.Join(r.dir, "volumes")
	for _, d := range []string{volDir, filepath.Join(r.dir, "containers")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			r.failStop("PodDirectoryError", err.Error())
			return false
		}
	}
	bo := &backoff{max: 10 * time.Second}
	last := ""
	var vols map[string]*volumes.Volume
	for {
		vols, err = r.p.mat.Prepare(pod, volDir)
		if err == nil {
			break
		}
		if volumes.IsUnsupported(err) {
			r.event(nil, v1.EventTypeWarning, "FailedMount", err.Error())
			r.failStop("UnsupportedVolume", err.Error())
			return false
		}
		if msg := err.Error(); msg != last {
			last = msg
			r.log.Warn("volume setup failed, retrying", "err", err)
			r.event(nil, v1.EventTypeWarning, "FailedMount", "MountVolume.SetUp failed: "+msg)
		}
		if !r.sleep(bo.next(0)) {
			return false
		}
		pod = r.podCopy()
	}
	shm := filepath.Join(r.dir, "shm")
	if err := os.MkdirAll(shm, 0o1777); err != nil {
		r.failStop("PodDirectoryError", err.Error())
		return false
	}
	if err := r.mountTmpfs(shm, shmSize); err != nil {
		r.failStop("PodDirectoryError", "pod /dev/shm: "+err.Error())
		return false
	}
	var fsGroup *int64
	if pod.Spec.SecurityContext != nil {
		fsGroup = pod.Spec.SecurityContext.FSGroup
	}
	for _, v := range vols {
		if v.Memory {
			if err := r.mountTmpfs(v.Path, v.SizeLimit); err != nil {
				r.failStop("FailedMount", fmt.Sprintf("volume %q: tmpfs: %v", v.Name, err))
				return false
			}
		}
		if pod.Spec.Volumes != nil && fsGroup != nil && !v.ReadOnlyKind && isEmptyDir(pod, v.Name) {
			if err := volumes.ApplyFSGroup(v.Path, *fsGroup, false); err != nil {
				r.failStop("FailedMount", fmt.Sprintf("volume %q: fsGroup: %v", v.Name, err))
				return false
			}
		}
	}
	r.mu.Lock()
	r.vols, r.shmDir = vols, shm
	r.view.SandboxReady = true
	if len(r.init) == 0 {
		for _, c := range r.app {
			c.st.State = status.Waiting("ContainerCreating", "")
		}
	}
	r.mu.Unlock()
	go r.refreshTokens(pod)
	r.push()
	return true
}

func isEmptyDir(pod *v1.Pod, name string) bool {
	for _, v := range pod.Spec.Volumes {
		if v.Name == name {
			return v.EmptyDir != nil
		}
	}
	return false
}

// mountTmpfs mounts a tmpfs in the node's private mount namespace, so it
// vanishes with the node whatever happens.
func (r *podRunner) mountTmpfs(path string, size int64) error {
	opts := "mode=1777"
	if size > 0 {
		opts += ",size=" + strconv.FormatInt(size, 10)
	}
	if err := unix.Mount("tmpfs", path, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return err
	}
	r.mu.Lock()
	r.tmpfs = append(r.tmpfs, path)
	r.mu.Unlock()
	return nil
}

// refreshTokens renews projected service account tokens before they expire.
func (r *podRunner) refreshTokens(pod *v1.Pod) {
	for {
		var next time.Time
		r.mu.Lock()
		vols := r.vols
		r.mu.Unlock()
		for _, v := range vols {
			if len(v.Tokens) == 0 {
				continue
			}
			n, err := r.p.mat.RefreshTokens(pod, v, time.Now())
			if err != nil {
				r.log.Warn("refreshing service account token", "volume", v.Name, "err", err)
			}
			if !n.IsZero() && (next.IsZero() || n.Before(next)) {
				next = n
			}
		}
		if next.IsZero() {
			return
		}
		if !r.sleep(time.Until(next)) {
			return
		}
	}
}

// watchDeadline enforces activeDeadlineSeconds.
func (r *podRunner) watchDeadline() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-r.haltCh:
			return
		case <-t.C:
		}
		r.mu.Lock()
		ads := r.pod.Spec.ActiveDeadlineSeconds
		start := r.view.StartTime
		r.mu.Unlock()
		if ads != nil && start != nil && time.Since(start.Time) > time.Duration(*ads)*time.Second {
			r.event(nil, v1.EventTypeNormal, "DeadlineExceeded", "Pod was active on the node longer than the specified deadline")
			r.failStop("DeadlineExceeded", "Pod was active on the node longer than the specified deadline")
			return
		}
	}
}

// runInits runs init containers one by one; restartable (sidecar) ones are
// started and left running once they have started.
func (r *podRunner) runInits() bool {
	for _, c := range r.init {
		if c.sidecar {
			r.sidecars.Add(1)
			go func() { defer r.sidecars.Done(); c.loop() }()
			if !r.waitStarted(c) {
				return false
			}
			continue
		}
		if !r.runInit(c) {
			return false
		}
	}
	return true
}

func (r *podRunner) waitStarted(c *container) bool {
	for {
		r.mu.Lock()
		started := c.st.Started
		r.mu.Unlock()
		if started {
			return true
		}
		if !r.sleep(100 * time.Millisecond) {
			return false
		}
	}
}

// runInit runs one init container until it exits 0; a failure fails the pod
// under restartPolicy Never and is retried with backoff otherwise.
func (r *podRunner) runInit(c *container) bool {
	bo := &backoff{max: maxBackoff}
	cfgBo := &backoff{max: 10 * time.Second}
	for {
		ex, ran, err := c.runOnce()
		if err == errHalted {
			return false
		}
		if err != nil {
			if !r.sleep(cfgBo.next(0)) {
				return false
			}
			continue
		}
		if ex.ExitCode == 0 && ex.StartError == "" {
			return true
		}
		if r.podCopy().Spec.RestartPolicy == v1.RestartPolicyNever {
			r.mu.Lock()
			r.view.Failed = true
			r.mu.Unlock()
			return false
		}
		if r.isHalted() {
			return false
		}
		d := bo.next(ran)
		c.setBackoff(d)
		if !r.sleep(d) {
			return false
		}
	}
}

// runApps starts all app containers together and waits until none of them
// will run again.
func (r *podRunner) runApps() {
	r.mu.Lock()
	r.view.InitDone = true
	for _, c := range r.app {
		c.st.State = status.Waiting("ContainerCreating", "")
	}
	r.mu.Unlock()
	r.push()
	var wg sync.WaitGroup
	for _, c := range r.app {
		wg.Add(1)
		go func() { defer wg.Done(); c.loop() }()
	}
	wg.Wait()
}

// haltAll forbids any further start and stops every running container:
// preStop hooks, SIGTERM, the grace period, SIGKILL. App and init containers
// go first, sidecars after them.
func (r *podRunner) haltAll() {
	r.haltOnce.Do(func() {
		r.mu.Lock()
		r.halted = true
		close(r.haltCh)
		if r.deadline.IsZero() {
			r.deadline = time.Now().Add(gracePeriod(r.pod))
		}
		var first, last []*container
		for _, c := range append(append([]*container{}, r.init...), r.app...) {
			if c.running() {
				if c.sidecar {
					last = append(last, c)
				} else {
					first = append(first, c)
				}
			}
		}
		r.mu.Unlock()
		stopAll := func(cs []*container) {
			var wg sync.WaitGroup
			for _, c := range cs {
				wg.Add(1)
				go func() { defer wg.Done(); c.stopInstance(r.getDeadline, "Stopping container "+c.spec.Name) }()
			}
			wg.Wait()
		}
		stopAll(first)
		stopAll(last)
	})
}

// finalize puts every container in a terminal state for the final status.
func (r *podRunner) finalize() {
	r.mu.Lock()
	now := metav1.Now()
	for _, c := range append(append([]*container{}, r.init...), r.app...) {
		if c.st.State.Waiting == nil {
			continue
		}
		if c.st.LastState.Terminated != nil {
			c.st.State, c.st.LastState = c.st.LastState, v1.ContainerState{}
			continue
		}
		if r.view.Deleting || r.view.Failed {
			c.st.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
				ExitCode: 137, Reason: "ContainerStatusUnknown", FinishedAt: now,
				Message: "The container could not be located when the pod was terminated",
			}}
		}
	}
	r.view.SandboxClosed = true
	r.mu.Unlock()
	r.release()
}

// release frees what a finished pod no longer needs (tmpfs, writable layers,
// GPUs); its logs stay until the pod is deleted.
func (r *podRunner) release() {
	r.mu.Lock()
	if r.released {
		r.mu.Unlock()
		return
	}
	r.released = true
	mounts := r.tmpfs
	r.mu.Unlock()
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(mounts[i], unix.MNT_DETACH); err != nil {
			r.log.Warn("unmounting", "path", mounts[i], "err", err)
		}
	}
	for _, c := range append(append([]*container{}, r.init...), r.app...) {
		for _, d := range []string{"root", "upper", "work", "devupper", "devwork"} {
			_ = os.RemoveAll(filepath.Join(c.dir, d))
		}
	}
	r.p.gpus.Release(r.key)
}

// push computes the pod's status and hands it to the pod controller. Pushes
// are serialised so a newer status is never overtaken by an older one.
func (r *podRunner) push() {
	r.pushMu.Lock()
	defer r.pushMu.Unlock()
	pod := r.buildStatus()
	if f := r.p.notifier(); f != nil {
		f(pod)
	}
}

func (r *podRunner) buildStatus() *v1.Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	base := r.pod.DeepCopy()
	if cur, err := r.p.cfg.Pods.Pods(base.Namespace).Get(base.Name); err == nil && cur.UID == base.UID {
		// Conditions others own (readiness gates), the QoS class ...
		base.Status = *cur.Status.DeepCopy()
	}
	// ... and our own conditions as we last computed them (transition times).
	for _, mine := range r.last.Conditions {
		found := false
		for i := range base.Status.Conditions {
			if base.Status.Conditions[i].Type == mine.Type {
				base.Status.Conditions[i] = mine
				found = true
			}
		}
		if !found {
			base.Status.Conditions = append(base.Status.Conditions, mine)
		}
	}
	view := r.view
	view.Init = make([]status.Container, len(r.init))
	for i, c := range r.init {
		view.Init[i] = c.st
	}
	view.App = make([]status.Container, len(r.app))
	for i, c := range r.app {
		view.App[i] = c.st
	}
	st := status.Build(base, &view, time.Now())
	r.last = st
	out := r.pod.DeepCopy()
	out.Status = *st.DeepCopy()
	return out
}

// event records a Kubernetes event about the pod or one of its containers.
func (r *podRunner) event(c *container, eventType, reason, msg string) {
	r.mu.Lock()
	ref := &v1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: r.pod.Namespace, Name: r.pod.Name, UID: r.pod.UID, ResourceVersion: r.pod.ResourceVersion}
	r.mu.Unlock()
	if c != nil {
		if c.isInit {
			ref.FieldPath = "spec.initContainers{" + c.spec.Name + "}"
		} else {
			ref.FieldPath = "spec.containers{" + c.spec.Name + "}"
		}
	}
	if r.p.cfg.Recorder != nil {
		r.p.cfg.Recorder.Event(ref, eventType, reason, msg)
	}
}

// logFile finds the log of a container's current (or previous) instance.
func (r *podRunner) logFile(name string, previous bool) (string, func() bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var c *container
	all := append(append([]*container{}, r.init...), r.app...)
	if name == "" && len(r.app) == 1 {
		c = r.app[0]
	}
	for _, x := range all {
		if x.spec.Name == name {
			c = x
		}
	}
	if c == nil {
		return "", nil, errdefs.NotFoundf("container %q is not in pod %s", name, r.key)
	}
	idx := c.instances
	if previous {
		idx--
		if idx < 1 {
			return "", nil, errdefs.InvalidInputf("previous terminated container %q in pod %q not found", name, r.pod.Name)
		}
	}
	if idx < 1 {
		reason := "ContainerCreating"
		if w := c.st.State.Waiting; w != nil {
			reason = w.Reason
		}
		return "", nil, errdefs.InvalidInputf("container %q in pod %q is waiting to start: %s", name, r.pod.Name, reason)
	}
	proc, procIdx := c.proc, c.procIdx
	finished := func() bool {
		return proc == nil || procIdx != idx || proc.LogsFlushed()
	}
	return c.logPath(idx), finished, nil
}
