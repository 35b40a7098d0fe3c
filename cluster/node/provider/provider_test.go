package provider

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/runtime"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

const privateNS = "FUSEFORGE_PROVIDER_TEST_NS"

// TestMain doubles as the container child (runtime.Start re-executes this
// binary) and, as root, re-runs the tests in a private mount namespace so the
// pods' tmpfs mounts never reach the host.
func TestMain(m *testing.M) {
	if len(os.Args) > 2 && os.Args[1] == runtime.SubcommandName {
		runtime.ChildMain(os.Args[2])
		return
	}
	if os.Geteuid() == 0 && os.Getenv(privateNS) == "" {
		cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
		cmd.Env = append(os.Environ(), privateNS+"=1")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Run(); err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				os.Exit(ee.ExitCode())
			}
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(privateNS) != "" {
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// harness is a provider with a fake API and a recorder of pushed statuses.
type harness struct {
	t      *testing.T
	p      *Provider
	client *fake.Clientset
	index  cache.Indexer
	mu     sync.Mutex
	last   map[string]*v1.Pod
	seen   map[string][]v1.PodStatus
}

func newHarness(t *testing.T, mutate func(*config.Config)) *harness {
	if os.Geteuid() != 0 {
		t.Skip("running containers needs root (mount namespaces)")
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Skip("nsenter not found")
	}
	state := t.TempDir()
	cfg := &config.Config{
		NodeName: "n1", StateDir: state, GPUs: 2, DNSIP: net.ParseIP("127.0.0.10"), ClusterDomain: "cluster.local",
		Path: "/opt/test-bin", CPUs: resource.MustParse("4"), Memory: resource.MustParse("8Gi"),
		Env: []config.KV{{Key: "NODE_EXTRA", Value: "yes"}},
	}
	if mutate != nil {
		mutate(cfg)
	}
	client := fake.NewSimpleClientset(
		&v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: "ns"}, Data: map[string]string{"a.yaml": "key: value\n"}},
	)
	index := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	h := &harness{t: t, client: client, index: index, last: map[string]*v1.Pod{}, seen: map[string][]v1.PodStatus{}}
	h.p = New(Config{Node: cfg, Client: client, Pods: corev1listers.NewPodLister(index),
		Services:    corev1listers.NewServiceLister(cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})),
		Allocatable: v1.ResourceList{v1.ResourceCPU: cfg.CPUs, v1.ResourceMemory: cfg.Memory}, APIPort: "6443", HostPath: os.Getenv("PATH")})
	h.p.NotifyPods(context.Background(), func(p *v1.Pod) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.last[p.Name] = p
		h.seen[p.Name] = append(h.seen[p.Name], p.Status)
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		h.p.Shutdown(ctx)
	})
	return h
}

func (h *harness) create(pod *v1.Pod) {
	h.t.Helper()
	pod.Namespace = "ns"
	pod.UID = types.UID("uid-" + pod.Name)
	pod.Spec.NodeName = "n1"
	if pod.Spec.RestartPolicy == "" {
		pod.Spec.RestartPolicy = v1.RestartPolicyNever
	}
	for _, cs := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range cs {
			if cs[i].TerminationMessagePath == "" {
				cs[i].TerminationMessagePath = "/dev/termination-log"
			}
		}
	}
	if _, err := h.client.CoreV1().Pods("ns").Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	_ = h.index.Add(pod)
	if err := h.p.CreatePod(context.Background(), pod); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) pod(name string) *v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.last[name]
}

func (h *harness) wait(name string, timeout time.Duration, what string, ok func(*v1.Pod) bool) *v1.Pod {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if p := h.pod(name); p != nil && ok(p) {
			return p
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pod %s: timed out waiting for %s; last status %+v", name, what, h.pod(name))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (h *harness) done(name string, timeout time.Duration) *v1.Pod {
	h.t.Helper()
	return h.wait(name, timeout, "a terminal phase", func(p *v1.Pod) bool {
		return p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed
	})
}

func (h *harness) logs(name, container string, previous bool) string {
	h.t.Helper()
	rc, err := h.p.GetContainerLogs(context.Background(), "ns", name, container, api.ContainerLogOpts{Previous: previous})
	if err != nil {
		h.t.Fatalf("logs %s/%s: %v", name, container, err)
	}
	defer rc.Close()
	b, _ := io.ReadAll(rc)
	return string(b)
}

func (h *harness) delete(name string, timeout time.Duration) time.Duration {
	h.t.Helper()
	pod, err := h.p.GetPod(context.Background(), "ns", name)
	if err != nil {
		h.t.Fatal(err)
	}
	start := time.Now()
	if err := h.p.DeletePod(context.Background(), pod); err != nil {
		h.t.Fatal(err)
	}
	for h.p.get("ns", name) != nil {
		if time.Since(start) > timeout {
			h.t.Fatalf("pod %s not removed within %s", name, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(h.p.podsDir, string(pod.UID))); !os.IsNotExist(err) {
		h.t.Errorf("pod directory left behind: %v", err)
	}
	return time.Since(start)
}

func sh(script string) []string { return []string{"sh", "-c", script} }

func ptr[T any](v T) *T { return &v }

func TestInitThenAppsNever(t *testing.T) {
	h := newHarness(t, nil)
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "life"}, Spec: v1.PodSpec{
		Volumes: []v1.Volume{{Name: "w", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
		InitContainers: []v1.Container{
			{Name: "i1", Image: "img/init", Command: sh("echo one > /w/order"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}},
			{Name: "i2", Image: "img/init", Command: sh("echo two >> /w/order"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}},
		},
		Containers: []v1.Container{
			{Name: "ok", Image: "img/app", Command: sh("cat /w/order; echo $NODE_EXTRA $HOSTNAME; echo PATH=$PATH")},
			{Name: "bad", Image: "img/app", Command: sh("echo failing; exit 3"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}},
		},
	}})
	// The ok container has no mount of /w: it must not see it.
	p := h.done("life", 20*time.Second)
	if p.Status.Phase != v1.PodFailed {
		t.Fatalf("phase %s", p.Status.Phase)
	}
	byName := map[string]v1.ContainerStatus{}
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		byName[cs.Name] = cs
	}
	for name, want := range map[string]struct {
		code   int32
		reason string
	}{"i1": {0, "Completed"}, "i2": {0, "Completed"}, "ok": {0, "Completed"}, "bad": {3, "Error"}} {
		term := byName[name].State.Terminated
		if term == nil || term.ExitCode != want.code || term.Reason != want.reason {
			t.Errorf("%s: %+v, want %d %s", name, term, want.code, want.reason)
		}
	}
	if msg := byName["bad"].State.Terminated.Message; msg != "failing\n" {
		t.Errorf("termination message falls back to the log: %q", msg)
	}
	if !byName["i1"].Ready || byName["ok"].Ready {
		t.Error("completed init containers are ready, terminated app containers are not")
	}
	logs := h.logs("life", "ok", false)
	if !strings.Contains(logs, "No such file") || !strings.Contains(logs, "yes life") || !strings.Contains(logs, "PATH=/opt/test-bin:") {
		t.Errorf("ok logs: %q", logs)
	}
	// The init order is visible to the container that mounts the volume.
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "order"}, Spec: v1.PodSpec{
		Volumes: []v1.Volume{{Name: "w", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
		InitContainers: []v1.Container{
			{Name: "i1", Image: "img", Command: sh("echo one > /w/order"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}},
			{Name: "i2", Image: "img", Command: sh("sleep 0.3; echo two >> /w/order"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}},
		},
		Containers: []v1.Container{{Name: "c", Image: "img", Command: sh("cat /w/order"), VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}}}},
	}})
	if p := h.done("order", 20*time.Second); p.Status.Phase != v1.PodSucceeded {
		t.Fatalf("order: %s", p.Status.Phase)
	}
	if got := h.logs("order", "c", false); got != "one\ntwo\n" {
		t.Errorf("init containers ran out of order: %q", got)
	}
	// Phases went Pending -> Running? (short containers may skip Running) -> Failed, never back.
	h.mu.Lock()
	seen := h.seen["life"]
	h.mu.Unlock()
	if seen[0].Phase != v1.PodPending {
		t.Errorf("first phase %s", seen[0].Phase)
	}
	h.delete("life", 10*time.Second)
	h.delete("order", 10*time.Second)
}

func TestInitFailureRetriesUnlessNever(t *testing.T) {
	h := newHarness(t, nil)
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "never"}, Spec: v1.PodSpec{
		InitContainers: []v1.Container{{Name: "i", Image: "img", Command: sh("exit 2")}},
		Containers:     []v1.Container{{Name: "c", Image: "img", Command: sh("echo should-not-run")}},
	}})
	p := h.done("never", 20*time.Second)
	if p.Status.Phase != v1.PodFailed || p.Status.InitContainerStatuses[0].State.Terminated.ExitCode != 2 {
		t.Errorf("init failure under Never: %+v", p.Status)
	}
	if w := p.Status.ContainerStatuses[0].State; w.Running != nil || (w.Terminated != nil && w.Terminated.Reason == "Completed") {
		t.Errorf("app container must not run: %+v", w)
	}
	// OnFailure: the init container is retried with backoff until it succeeds.
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "retry"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyOnFailure,
		Volumes:       []v1.Volume{{Name: "w", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
		InitContainers: []v1.Container{{Name: "i", Image: "img", VolumeMounts: []v1.VolumeMount{{Name: "w", MountPath: "/w"}},
			Command: sh("echo x >> /w/tries; [ $(wc -l < /w/tries) -ge 2 ]")}},
		Containers: []v1.Container{{Name: "c", Image: "img", Command: sh("true")}},
	}})
	p = h.done("retry", 30*time.Second)
	if p.Status.Phase != v1.PodSucceeded || p.Status.InitContainerStatuses[0].RestartCount != 1 {
		t.Errorf("init retry: phase %s, init %+v", p.Status.Phase, p.Status.InitContainerStatuses)
	}
}

func TestRestartBackoffAndPrevious(t *testing.T) {
	h := newHarness(t, nil)
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "crash"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyAlways,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: sh("echo run-$(date +%s%N); exit 1")}},
	}})
	start := time.Now()
	p := h.wait("crash", 30*time.Second, "2 restarts", func(p *v1.Pod) bool {
		return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 2
	})
	// 1 s then 2 s of backoff before the third run.
	if took := time.Since(start); took < 2500*time.Millisecond {
		t.Errorf("restarts came too fast (%s): no backoff", took)
	}
	cs := p.Status.ContainerStatuses[0]
	if p.Status.Phase != v1.PodRunning || cs.LastTerminationState.Terminated == nil || cs.LastTerminationState.Terminated.ExitCode != 1 {
		t.Errorf("status while crash-looping: %s %+v", p.Status.Phase, cs)
	}
	sawBackoff := false
	h.mu.Lock()
	for _, st := range h.seen["crash"] {
		if len(st.ContainerStatuses) == 1 && st.ContainerStatuses[0].State.Waiting != nil && st.ContainerStatuses[0].State.Waiting.Reason == "CrashLoopBackOff" {
			sawBackoff = true
		}
	}
	h.mu.Unlock()
	if !sawBackoff {
		t.Error("never reported CrashLoopBackOff")
	}
	prev := h.logs("crash", "c", true)
	if !strings.HasPrefix(prev, "run-") {
		t.Errorf("previous log: %q", prev)
	}
	d := h.delete("crash", 10*time.Second)
	if d > 5*time.Second {
		t.Errorf("deleting a crash-looping pod took %s", d)
	}
}

func TestProbes(t *testing.T) {
	h := newHarness(t, nil)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	// Readiness over HTTP; liveness as an exec in the container's own root:
	// /tmp/alive exists only in this container's overlay.
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "probed"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyAlways,
		Containers: []v1.Container{{Name: "c", Image: "img",
			Ports:   []v1.ContainerPort{{Name: "http", ContainerPort: int32(port)}},
			Command: sh(fmt.Sprintf("touch /tmp/alive; (sleep 3; rm /tmp/alive) & exec python3 -m http.server %d --bind 127.0.0.1", port)),
			ReadinessProbe: &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
				PeriodSeconds: 1},
			LivenessProbe: &v1.Probe{ProbeHandler: v1.ProbeHandler{Exec: &v1.ExecAction{Command: []string{"test", "-f", "/tmp/alive"}}},
				PeriodSeconds: 1, FailureThreshold: 2},
		}},
	}})
	h.wait("probed", 20*time.Second, "Ready", func(p *v1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodReady && c.Status == v1.ConditionTrue {
				return true
			}
		}
		return false
	})
	if _, err := os.Stat("/tmp/alive"); err == nil {
		t.Error("the container's /tmp leaked to the host")
	}
	p := h.wait("probed", 30*time.Second, "a liveness restart", func(p *v1.Pod) bool {
		return p.Status.ContainerStatuses[0].RestartCount >= 1
	})
	if lt := p.Status.ContainerStatuses[0].LastTerminationState.Terminated; lt == nil || lt.ExitCode == 0 {
		t.Errorf("liveness kill: %+v", lt)
	}
	h.delete("probed", 40*time.Second)
}

func TestDeletionGrace(t *testing.T) {
	h := newHarness(t, nil)
	marker := t.TempDir()
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "term"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyAlways, TerminationGracePeriodSeconds: ptr(int64(10)),
		Volumes: []v1.Volume{{Name: "m", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: marker}}}},
		Containers: []v1.Container{{Name: "c", Image: "img", VolumeMounts: []v1.VolumeMount{{Name: "m", MountPath: "/m"}},
			Lifecycle: &v1.Lifecycle{PreStop: &v1.LifecycleHandler{Exec: &v1.ExecAction{Command: sh("echo prestop > /m/prestop")}}},
			Command:   sh(`trap 'echo term >> /m/log; sleep 1; exit 0' TERM; sleep 1000 & echo up > /m/up; while true; do sleep 0.1; done`)}},
	}})
	h.wait("term", 20*time.Second, "running", func(p *v1.Pod) bool { return p.Status.Phase == v1.PodRunning })
	for i := 0; ; i++ {
		if _, err := os.Stat(filepath.Join(marker, "up")); err == nil {
			break
		}
		if i > 200 {
			t.Fatal("container never came up")
		}
		time.Sleep(50 * time.Millisecond)
	}
	took := h.delete("term", 20*time.Second)
	if took < time.Second || took > 6*time.Second {
		t.Errorf("graceful stop took %s", took)
	}
	if b, _ := os.ReadFile(filepath.Join(marker, "log")); string(b) != "term\n" {
		t.Errorf("SIGTERM handler: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(marker, "prestop")); string(b) != "prestop\n" {
		t.Errorf("preStop hook: %q", b)
	}
	if out, _ := exec.Command("pgrep", "-f", "sleep 1000").Output(); len(out) > 0 {
		t.Errorf("the container's background process survived: %s", out)
	}
	final := h.pod("term")
	if final.Status.Phase != v1.PodSucceeded || final.Status.ContainerStatuses[0].State.Terminated == nil {
		t.Errorf("final status after deletion: %s %+v", final.Status.Phase, final.Status.ContainerStatuses)
	}
}

func TestSecurityAndFilesystem(t *testing.T) {
	h := newHarness(t, func(c *config.Config) {
		c.Entrypoints = []config.Entrypoint{{Prefix: "ep/", Argv: []string{"sh", "-c"}}}
	})
	size := resource.MustParse("8Mi")
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "sec"}, Spec: v1.PodSpec{
		Hostname: "h1", Subdomain: "grp",
		SecurityContext: &v1.PodSecurityContext{RunAsUser: ptr(int64(1234)), RunAsGroup: ptr(int64(1234)), FSGroup: ptr(int64(4321))},
		Volumes: []v1.Volume{
			{Name: "data", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}},
			{Name: "cfg", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "app"}}}},
		},
		Containers: []v1.Container{{Name: "c", Image: "ep/tool:1",
			Args: []string{`id -u; id -G; echo x > /data/f && stat -c %g /data/f; touch /rootfile 2>/dev/null || echo root-ro;
grep NoNewPrivs /proc/self/status; cat /etc/app/a.yaml; echo > /etc/app/a.yaml 2>/dev/null || echo cfg-ro;
hostname; grep h1.grp /etc/hosts; df -k /dev/shm | tail -1; echo custom > /dev/termination-log; exit 7`},
			SecurityContext: &v1.SecurityContext{ReadOnlyRootFilesystem: ptr(true), AllowPrivilegeEscalation: ptr(false)},
			VolumeMounts:    []v1.VolumeMount{{Name: "data", MountPath: "/data"}, {Name: "cfg", MountPath: "/etc/app/a.yaml", SubPath: "a.yaml"}},
		}},
	}})
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "shm"}, Spec: v1.PodSpec{
		Volumes: []v1.Volume{{Name: "dshm", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{Medium: v1.StorageMediumMemory, SizeLimit: &size}}}},
		Containers: []v1.Container{{Name: "c", Image: "img", Command: sh("df -k /dev/shm | tail -1; echo GPU=$CUDA_VISIBLE_DEVICES/$NVIDIA_VISIBLE_DEVICES"),
			Resources:    v1.ResourceRequirements{Limits: v1.ResourceList{"nvidia.com/gpu": resource.MustParse("1")}},
			VolumeMounts: []v1.VolumeMount{{Name: "dshm", MountPath: "/dev/shm"}}}},
		RestartPolicy: v1.RestartPolicyNever,
	}})
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "nonroot"}, Spec: v1.PodSpec{
		SecurityContext: &v1.PodSecurityContext{RunAsNonRoot: ptr(true)},
		Containers:      []v1.Container{{Name: "c", Image: "img", Command: sh("true")}},
	}})
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pvc"}, Spec: v1.PodSpec{
		Volumes:    []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: "c"}}}},
		Containers: []v1.Container{{Name: "c", Image: "img", Command: sh("true")}},
	}})
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "deadline"}, Spec: v1.PodSpec{
		ActiveDeadlineSeconds: ptr(int64(1)), TerminationGracePeriodSeconds: ptr(int64(1)),
		Containers: []v1.Container{{Name: "c", Image: "img", Command: sh("sleep 30")}},
	}})
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "noexe"}, Spec: v1.PodSpec{
		Containers: []v1.Container{{Name: "c", Image: "img", Command: []string{"no-such-binary-xyz"}}},
	}})

	p := h.done("sec", 20*time.Second)
	logs := h.logs("sec", "c", false)
	term := p.Status.ContainerStatuses[0].State.Terminated
	if term == nil || term.ExitCode != 7 || term.Message != "custom\n" {
		t.Errorf("terminated: %+v (logs %q)", term, logs)
	}
	for _, want := range []string{"1234\n", "1234 4321\n", "4321\n", "root-ro\n", "NoNewPrivs:\t1\n", "key: value\n", "cfg-ro\n", "h1\n", "127.0.0.1\th1.grp.ns.svc.cluster.local\th1\n", " 65536 "} {
		if !strings.Contains(logs, want) {
			t.Errorf("sec logs lack %q:\n%s", want, logs)
		}
	}
	h.done("shm", 20*time.Second)
	if logs := h.logs("shm", "c", false); !strings.Contains(logs, " 8192 ") || !strings.Contains(logs, "GPU=0/0") {
		t.Errorf("memory emptyDir at /dev/shm with sizeLimit, GPU env: %q", logs)
	}
	h.wait("nonroot", 20*time.Second, "CreateContainerConfigError", func(p *v1.Pod) bool {
		w := p.Status.ContainerStatuses[0].State.Waiting
		return w != nil && w.Reason == "CreateContainerConfigError" && strings.Contains(w.Message, "runAsNonRoot")
	})
	if p := h.done("pvc", 20*time.Second); p.Status.Phase != v1.PodFailed || !strings.Contains(p.Status.Message, "persistentVolumeClaim") {
		t.Errorf("PVC pod: %s %q", p.Status.Phase, p.Status.Message)
	}
	if p := h.done("deadline", 20*time.Second); p.Status.Reason != "DeadlineExceeded" || p.Status.Phase != v1.PodFailed {
		t.Errorf("deadline pod: %s %q", p.Status.Phase, p.Status.Reason)
	}
	p = h.done("noexe", 20*time.Second)
	if term := p.Status.ContainerStatuses[0].State.Terminated; term == nil || term.Reason != "StartError" || term.ExitCode != 128 || !strings.Contains(term.Message, "executable file not found") {
		t.Errorf("missing executable: %+v", term)
	}
}

func TestSidecarInitContainer(t *testing.T) {
	h := newHarness(t, nil)
	always := v1.ContainerRestartPolicyAlways
	h.create(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "side"}, Spec: v1.PodSpec{
		TerminationGracePeriodSeconds: ptr(int64(2)),
		InitContainers:                []v1.Container{{Name: "proxy", Image: "img", RestartPolicy: &always, Command: sh("while true; do sleep 0.1; done")}},
		Containers:                    []v1.Container{{Name: "main", Image: "img", Command: sh("sleep 0.5; echo main-done")}},
	}})
	p := h.done("side", 20*time.Second)
	if p.Status.Phase != v1.PodSucceeded {
		t.Errorf("phase %s: %+v", p.Status.Phase, p.Status)
	}
	if p.Status.InitContainerStatuses[0].State.Terminated == nil {
		t.Errorf("the sidecar must be stopped once the app containers are done: %+v", p.Status.InitContainerStatuses[0])
	}
}
