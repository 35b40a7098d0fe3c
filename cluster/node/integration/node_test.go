package integration

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
)

const ns = "it"

func ptr[T any](v T) *T { return &v }

// TestNode checks the node end to end against a real API server.
func TestNode(t *testing.T) {
	kubeBin := os.Getenv("FUSEFORGE_KUBE_BIN")
	if kubeBin == "" {
		t.Skip("FUSEFORGE_KUBE_BIN is not set (path of the kube binary with etcd and kube-apiserver)")
	}
	if os.Geteuid() != 0 {
		t.Skip("the node needs root (mount namespaces)")
	}
	bin := filepath.Join(t.TempDir(), "node")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the node: %v\n%s", err, out)
	}
	c := startCluster(t, kubeBin)
	defer c.stop()
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(c.dir, "node.log"))
			if len(b) > 20000 {
				b = b[len(b)-20000:]
			}
			t.Logf("node log (tail):\n%s", b)
		}
	}()
	ctx := context.Background()
	k := c.admin
	setupNamespace(t, k)
	c.startNode(bin)
	waitFor(t, 60*time.Second, "node Ready", func() (bool, error) {
		n, err := k.CoreV1().Nodes().Get(ctx, "it-node", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cnd := range n.Status.Conditions {
			if cnd.Type == v1.NodeReady && cnd.Status == v1.ConditionTrue {
				gpus := n.Status.Allocatable["nvidia.com/gpu"]
				if gpus.Value() != 2 {
					return false, fmt.Errorf("nvidia.com/gpu allocatable = %s", gpus.String())
				}
				return true, nil
			}
		}
		return false, nil
	})

	t.Run("lifecycle", func(t *testing.T) { testLifecycle(t, k) })
	t.Run("logs", func(t *testing.T) { testLogsThroughAPIServer(t, k) })
	t.Run("sigterm-grace", func(t *testing.T) { testSigterm(t, c) })
	t.Run("sigkill-after-grace", func(t *testing.T) { testSigkill(t, k) })
	t.Run("dns", func(t *testing.T) { testDNS(t, k) })
	t.Run("config-error", func(t *testing.T) { testConfigError(t, k) })
	t.Run("restart-backoff", func(t *testing.T) { testRestart(t, k) })
	t.Run("follow-and-exec", func(t *testing.T) { testFollowAndExec(t, c) })
	t.Run("lease", func(t *testing.T) {
		l, err := k.CoordinationV1().Leases("kube-node-lease").Get(ctx, "it-node", metav1.GetOptions{})
		if err != nil || l.Spec.RenewTime == nil {
			t.Fatalf("node lease: %v %+v", err, l)
		}
	})
	t.Run("crash-and-restart", func(t *testing.T) { testCrashRestart(t, c, bin) })

	// A running pod when the node stops: it must go, with its processes and files.
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "long"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyAlways, TerminationGracePeriodSeconds: ptr(int64(3)),
		Containers: []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c", "sleep 1000 & wait"}}},
	}})
	waitPhase(t, k, "long", v1.PodRunning, 30*time.Second)
	start := time.Now()
	code, err := c.stopNode(60 * time.Second)
	if err != nil || code != 0 {
		t.Fatalf("node stop: code %d, err %v", code, err)
	}
	t.Logf("node stopped in %s", time.Since(start).Round(time.Millisecond))
	if entries, _ := os.ReadDir(filepath.Join(c.stateDir, "pods")); len(entries) > 0 {
		t.Errorf("pod directories left behind: %v", entries)
	}
	if out, _ := exec.Command("pgrep", "-f", "sleep 1000").Output(); len(out) > 0 {
		t.Errorf("container processes outlived the node: %s", out)
	}
	p, err := k.CoreV1().Pods(ns).Get(ctx, "long", metav1.GetOptions{})
	if err != nil || p.Status.Phase != v1.PodFailed || p.Status.Reason != "NodeShutdown" {
		t.Errorf("after node shutdown: phase %s reason %q err %v", p.Status.Phase, p.Status.Reason, err)
	}
}

func setupNamespace(t *testing.T, k kubernetes.Interface) {
	ctx := context.Background()
	mustCreate(t, func() error {
		_, err := k.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		return err
	})
	// What kube-controller-manager would provide: the default ServiceAccount and the root CA ConfigMap.
	mustCreate(t, func() error {
		_, err := k.CoreV1().ServiceAccounts(ns).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := k.CoreV1().ConfigMaps(ns).Create(ctx, &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kube-root-ca.crt"}, Data: map[string]string{"ca.crt": "test-ca\n"}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := k.CoreV1().ConfigMaps(ns).Create(ctx, &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cfg"}, Data: map[string]string{"greeting": "hello", "LEVEL": "debug"}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := k.CoreV1().Secrets(ns).Create(ctx, &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "sec"}, Data: map[string][]byte{"password": []byte("s3cr3t")}}, metav1.CreateOptions{})
		return err
	})
}

func mustCreate(t *testing.T, f func() error) {
	t.Helper()
	if err := f(); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, timeout time.Duration, what string, f func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := f()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// mkPod creates a pod bound to the node (there is no scheduler here).
func mkPod(t *testing.T, k kubernetes.Interface, p *v1.Pod) {
	t.Helper()
	p.Namespace = ns
	p.Spec.NodeName = "it-node"
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := k.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{})
		if err == nil {
			return
		}
		// The ServiceAccount admission plugin may not see the new SA yet.
		if time.Now().After(deadline) || !strings.Contains(err.Error(), "serviceaccount") {
			t.Fatalf("creating pod %s: %v", p.Name, err)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func getPod(t *testing.T, k kubernetes.Interface, name string) *v1.Pod {
	t.Helper()
	p, err := k.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func waitPhase(t *testing.T, k kubernetes.Interface, name string, phase v1.PodPhase, timeout time.Duration) *v1.Pod {
	t.Helper()
	var p *v1.Pod
	waitFor(t, timeout, fmt.Sprintf("pod %s %s", name, phase), func() (bool, error) {
		p = getPod(t, k, name)
		return p.Status.Phase == phase, nil
	})
	return p
}

func podLogs(t *testing.T, k kubernetes.Interface, name, container string) string {
	t.Helper()
	b, err := k.CoreV1().Pods(ns).GetLogs(name, &v1.PodLogOptions{Container: container}).DoRaw(context.Background())
	if err != nil {
		t.Fatalf("logs of %s/%s: %v", name, container, err)
	}
	return string(b)
}

// testLifecycle: init container, env from a ConfigMap and a Secret, the
// projected token volume, a readiness probe, and exit code 3.
func testLifecycle(t *testing.T, k kubernetes.Interface) {
	port := freePort(t)
	script := fmt.Sprintf(`python3 -m http.server %d --bind 127.0.0.1 >/dev/null 2>&1 &
i=0; while [ ! -f /tmp/ready-seen ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
echo "init: $(cat /work/init.txt)"
echo "env: $GREETING $PASSWORD $X_LEVEL $IT_EXTRA $POD_NAME $MEM_MI cpu=$CPU_LIMIT"
echo "ns: $(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)"
test -s /var/run/secrets/kubernetes.io/serviceaccount/token && echo token-present
echo "ca: $(cat /var/run/secrets/kubernetes.io/serviceaccount/ca.crt)"
echo "path: $PATH"
echo "host: $(hostname) $KUBERNETES_SERVICE_HOST"
echo "expand: $(printf %%s "$EXPANDED")"
echo "pwd: $(pwd)"
exit 3`, port)
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "life"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever,
		Volumes:       []v1.Volume{{Name: "work", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
		InitContainers: []v1.Container{{Name: "init", Image: "example.com/init:1", Command: []string{"sh", "-c", "echo init-ran > /work/init.txt"},
			VolumeMounts: []v1.VolumeMount{{Name: "work", MountPath: "/work"}}}},
		Containers: []v1.Container{{
			Name: "main", Image: "example.com/main:1", Command: []string{"sh", "-c", script}, WorkingDir: "/work",
			Resources: v1.ResourceRequirements{Limits: v1.ResourceList{v1.ResourceMemory: resource.MustParse("256Mi"), v1.ResourceCPU: resource.MustParse("1500m")}},
			Env: []v1.EnvVar{
				{Name: "GREETING", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "cfg"}, Key: "greeting"}}},
				{Name: "PASSWORD", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "sec"}, Key: "password"}}},
				{Name: "POD_NAME", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
				{Name: "MEM_MI", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "limits.memory", Divisor: resource.MustParse("1Mi")}}},
				{Name: "CPU_LIMIT", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "limits.cpu"}}},
				{Name: "EXPANDED", Value: "$(GREETING)-$$(GREETING)-$(NOPE)"},
			},
			EnvFrom:      []v1.EnvFromSource{{Prefix: "X_", ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "cfg"}}}},
			VolumeMounts: []v1.VolumeMount{{Name: "work", MountPath: "/work"}},
			ReadinessProbe: &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(int32(port))}},
				PeriodSeconds: 1},
		}},
	}})
	// Readiness must be seen True before the container exits.
	sawReady := false
	waitFor(t, 60*time.Second, "pod life Ready", func() (bool, error) {
		p := getPod(t, k, "life")
		for _, cnd := range p.Status.Conditions {
			if cnd.Type == v1.PodReady && cnd.Status == v1.ConditionTrue {
				sawReady = true
			}
		}
		if p.Status.Phase == v1.PodFailed && !sawReady {
			return false, fmt.Errorf("pod failed before it was seen Ready: %+v", p.Status)
		}
		return sawReady, nil
	})
	// Let the script finish (it polls for a file nobody writes; 10 s at most).
	p := waitPhase(t, k, "life", v1.PodFailed, 40*time.Second)
	if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].State.Terminated == nil {
		t.Fatalf("container status: %+v", p.Status.ContainerStatuses)
	}
	term := p.Status.ContainerStatuses[0].State.Terminated
	if term.ExitCode != 3 || term.Reason != "Error" {
		t.Errorf("terminated = %+v, want exit code 3 reason Error", term)
	}
	if !strings.Contains(term.Message, "exit") && !strings.Contains(term.Message, "pwd") {
		t.Errorf("termination message should hold the log's end, got %q", term.Message)
	}
	cs := p.Status.ContainerStatuses[0]
	if cs.Image != "example.com/main:1" || cs.ImageID != "host-process://example.com/main:1" || !strings.HasPrefix(cs.ContainerID, "host-process://") {
		t.Errorf("image fields: %q %q %q", cs.Image, cs.ImageID, cs.ContainerID)
	}
	if ic := p.Status.InitContainerStatuses; len(ic) != 1 || ic[0].State.Terminated == nil || ic[0].State.Terminated.ExitCode != 0 || ic[0].State.Terminated.Reason != "Completed" {
		t.Errorf("init container status: %+v", ic)
	}
	if p.Status.PodIP != "127.0.0.1" || p.Status.HostIP != "127.0.0.1" || p.Status.StartTime == nil {
		t.Errorf("pod IPs/start time: %q %q %v", p.Status.PodIP, p.Status.HostIP, p.Status.StartTime)
	}
	logs := podLogs(t, k, "life", "main")
	for _, want := range []string{
		"init: init-ran", "env: hello s3cr3t debug from-node life 256 cpu=2", "ns: it", "token-present", "ca: test-ca",
		"path: /opt/it-bin:", "host: life 127.0.0.1", "expand: hello-$(GREETING)-$(NOPE)", "pwd: /work",
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %q:\n%s", want, logs)
		}
	}
}

// testLogsThroughAPIServer: tail, timestamps and previous through GET pods/log.
func testLogsThroughAPIServer(t *testing.T, k kubernetes.Interface) {
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "logs"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c", "for i in 1 2 3 4 5; do echo line$i; done; sleep 0.3; echo err >&2"}}},
	}})
	waitPhase(t, k, "logs", v1.PodSucceeded, 30*time.Second)
	all := podLogs(t, k, "logs", "c")
	if !strings.Contains(all, "line1\nline2\nline3\nline4\nline5\n") || !strings.Contains(all, "err\n") {
		t.Errorf("logs: %q", all)
	}
	tail, err := k.CoreV1().Pods(ns).GetLogs("logs", &v1.PodLogOptions{Container: "c", TailLines: ptr(int64(2)), Timestamps: true}).DoRaw(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(tail)), "\n")
	if len(lines) != 2 || !strings.HasSuffix(lines[1], " err") && !strings.HasSuffix(lines[1], " line5") {
		t.Errorf("tail 2 with timestamps: %q", tail)
	}
	if _, err := time.Parse(time.RFC3339Nano, strings.Fields(lines[0])[0]); err != nil {
		t.Errorf("timestamp: %v", err)
	}
	limited, err := k.CoreV1().Pods(ns).GetLogs("logs", &v1.PodLogOptions{Container: "c", LimitBytes: ptr(int64(8))}).DoRaw(context.Background())
	if err != nil || string(limited) != "line1\nli" {
		t.Errorf("limitBytes 8: %q %v", limited, err)
	}
}

// testSigterm: deleting a pod whose process traps SIGTERM: it gets SIGTERM,
// has time to finish, and the pod goes as soon as it has.
func testSigterm(t *testing.T, c *cluster) {
	k := c.admin
	marker := filepath.Join(c.dir, "term-marker")
	if err := os.MkdirAll(marker, 0o777); err != nil {
		t.Fatal(err)
	}
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "term"}, Spec: v1.PodSpec{
		TerminationGracePeriodSeconds: ptr(int64(20)),
		Volumes:                       []v1.Volume{{Name: "m", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: marker}}}},
		Containers: []v1.Container{{Name: "c", Image: "img", VolumeMounts: []v1.VolumeMount{{Name: "m", MountPath: "/marker"}},
			Command: []string{"sh", "-c", `trap 'echo got-sigterm > /marker/out; sleep 2; echo done >> /marker/out; exit 0' TERM; echo up > /marker/up; while true; do sleep 0.2; done`}}},
	}})
	waitPhase(t, k, "term", v1.PodRunning, 30*time.Second)
	waitFor(t, 10*time.Second, "container up", func() (bool, error) {
		_, err := os.Stat(filepath.Join(marker, "up"))
		return err == nil, nil
	})
	start := time.Now()
	if err := k.CoreV1().Pods(ns).Delete(context.Background(), "term", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "pod term gone", func() (bool, error) {
		_, err := k.CoreV1().Pods(ns).Get(context.Background(), "term", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	took := time.Since(start)
	b, _ := os.ReadFile(filepath.Join(marker, "out"))
	if string(b) != "got-sigterm\ndone\n" {
		t.Errorf("marker = %q, want the SIGTERM handler to have run to its end", b)
	}
	if took < 2*time.Second || took > 15*time.Second {
		t.Errorf("deletion took %s: want the handler's 2 s, not the 20 s grace period", took)
	}
	t.Logf("graceful deletion took %s", took.Round(time.Millisecond))
}

// testSigkill: a process that ignores SIGTERM is killed when the grace period ends.
func testSigkill(t *testing.T, k kubernetes.Interface) {
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "stubborn"}, Spec: v1.PodSpec{
		TerminationGracePeriodSeconds: ptr(int64(2)),
		Containers: []v1.Container{{Name: "c", Image: "img",
			Command: []string{"sh", "-c", `trap '' TERM; echo up; while true; do sleep 0.2; done`}}},
	}})
	waitPhase(t, k, "stubborn", v1.PodRunning, 30*time.Second)
	start := time.Now()
	if err := k.CoreV1().Pods(ns).Delete(context.Background(), "stubborn", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "pod stubborn gone", func() (bool, error) {
		_, err := k.CoreV1().Pods(ns).Get(context.Background(), "stubborn", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if took := time.Since(start); took < 2*time.Second || took > 12*time.Second {
		t.Errorf("deletion took %s, want about the 2 s grace period", took)
	}
}

// testDNS: a Service name resolves to 127.0.0.1 from inside a pod, through
// the pod's resolv.conf search path; hostname.subdomain too.
func testDNS(t *testing.T, k kubernetes.Interface) {
	ctx := context.Background()
	mustCreate(t, func() error {
		_, err := k.CoreV1().Services(ns).Create(ctx, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "myjob-master-0"},
			Spec: v1.ServiceSpec{Ports: []v1.ServicePort{{Port: 23456}}, Selector: map[string]string{"a": "b"}}}, metav1.CreateOptions{})
		return err
	})
	mustCreate(t, func() error {
		_, err := k.CoreV1().Services(ns).Create(ctx, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "workers"},
			Spec: v1.ServiceSpec{ClusterIP: v1.ClusterIPNone, Selector: map[string]string{"a": "b"}}}, metav1.CreateOptions{})
		return err
	})
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "dns"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever, Hostname: "w0", Subdomain: "workers",
		Containers: []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c",
			`set -e; cat /etc/resolv.conf; getent hosts myjob-master-0; getent hosts w0.workers
python3 -c 'import socket; print("py", socket.getaddrinfo("myjob-master-0", 23456)[0][4][0])'
if command -v nslookup >/dev/null; then nslookup myjob-master-0 | grep -A1 "^Name:" | tr -s " \t" " "; else echo "nslookup-missing"; fi
if getent hosts nosuch-svc; then echo unexpected; exit 1; fi; echo "svc env $MYJOB_MASTER_0_SERVICE_HOST:$MYJOB_MASTER_0_SERVICE_PORT"`}}},
	}})
	p := waitPhase2(t, k, "dns", 40*time.Second)
	logs := podLogs(t, k, "dns", "c")
	if p.Status.Phase != v1.PodSucceeded {
		t.Fatalf("dns pod %s:\n%s", p.Status.Phase, logs)
	}
	if !strings.Contains(logs, "nslookup-missing") && !strings.Contains(logs, "Name: myjob-master-0.it.svc.cluster.local\nAddress: 127.0.0.1") {
		t.Errorf("nslookup through the search path:\n%s", logs)
	}
	for _, want := range []string{
		"search it.svc.cluster.local svc.cluster.local cluster.local", "options ndots:5",
		"127.0.0.1       myjob-master-0.it.svc.cluster.local", "127.0.0.1       w0.workers.it.svc.cluster.local",
		"py 127.0.0.1", "svc env 127.0.0.1:23456",
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("dns pod logs lack %q:\n%s", want, logs)
		}
	}
}

// waitPhase2 waits for a terminal phase.
func waitPhase2(t *testing.T, k kubernetes.Interface, name string, timeout time.Duration) *v1.Pod {
	var p *v1.Pod
	waitFor(t, timeout, "pod "+name+" done", func() (bool, error) {
		p = getPod(t, k, name)
		return p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed, nil
	})
	return p
}

// testConfigError: a missing Secret key keeps the container waiting with
// CreateContainerConfigError naming it; runAsNonRoot as root likewise.
func testConfigError(t *testing.T, k kubernetes.Interface) {
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cfgerr"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever,
		Containers: []v1.Container{{Name: "c", Image: "img", Command: []string{"true"},
			Env: []v1.EnvVar{{Name: "X", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "sec"}, Key: "missing-key"}}}}}},
	}})
	waitFor(t, 30*time.Second, "CreateContainerConfigError", func() (bool, error) {
		p := getPod(t, k, "cfgerr")
		if len(p.Status.ContainerStatuses) == 1 {
			if w := p.Status.ContainerStatuses[0].State.Waiting; w != nil && w.Reason == "CreateContainerConfigError" {
				if !strings.Contains(w.Message, "missing-key") {
					return false, fmt.Errorf("message does not name the key: %q", w.Message)
				}
				return true, nil
			}
		}
		return false, nil
	})
	_ = k.CoreV1().Pods(ns).Delete(context.Background(), "cfgerr", metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
}

// testRestart: OnFailure restarts a failing container with backoff and
// counts restarts; the previous instance's log stays readable.
func testRestart(t *testing.T, k kubernetes.Interface) {
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "crash"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyOnFailure,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c", "echo run; exit 1"}}},
	}})
	waitFor(t, 40*time.Second, "two restarts", func() (bool, error) {
		p := getPod(t, k, "crash")
		return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 2, nil
	})
	p := getPod(t, k, "crash")
	cs := p.Status.ContainerStatuses[0]
	if cs.LastTerminationState.Terminated == nil || cs.LastTerminationState.Terminated.ExitCode != 1 {
		t.Errorf("lastState: %+v", cs.LastTerminationState)
	}
	if p.Status.Phase != v1.PodRunning {
		t.Errorf("phase %s, want Running while restarting", p.Status.Phase)
	}
	prev, err := k.CoreV1().Pods(ns).GetLogs("crash", &v1.PodLogOptions{Container: "c", Previous: true}).DoRaw(context.Background())
	if err != nil || string(prev) != "run\n" {
		t.Errorf("previous logs: %q %v", prev, err)
	}
	_ = k.CoreV1().Pods(ns).Delete(context.Background(), "crash", metav1.DeleteOptions{})
}

// testFollowAndExec: `kubectl logs -f` streams until the container exits;
// exec is refused with a message that says why.
func testFollowAndExec(t *testing.T, c *cluster) {
	k := c.admin
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "slow"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c", "for i in 1 2 3 4; do echo tick$i; sleep 0.5; done"}}},
	}})
	waitPhase(t, k, "slow", v1.PodRunning, 30*time.Second)
	start := time.Now()
	stream, err := k.CoreV1().Pods(ns).GetLogs("slow", &v1.PodLogOptions{Container: "c", Follow: true}).Stream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(stream)
	stream.Close()
	if err != nil || string(b) != "tick1\ntick2\ntick3\ntick4\n" {
		t.Errorf("follow: %q %v", b, err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("follow did not end with the container (%s)", took)
	}

	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "noexec"}, Spec: v1.PodSpec{
		TerminationGracePeriodSeconds: ptr(int64(1)),
		Containers:                    []v1.Container{{Name: "c", Image: "img", Command: []string{"sleep", "60"}}},
	}})
	waitPhase(t, k, "noexec", v1.PodRunning, 30*time.Second)
	req := k.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name("noexec").SubResource("exec").
		VersionedParams(&v1.PodExecOptions{Container: "c", Command: []string{"true"}, Stdout: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(c.adminCfg, "POST", req.URL())
	if err != nil {
		t.Fatal(err)
	}
	err = exe.StreamWithContext(context.Background(), remotecommand.StreamOptions{Stdout: io.Discard})
	if err == nil || !strings.Contains(err.Error(), "not supported by this node") {
		t.Errorf("exec should be refused with a clear message, got %v", err)
	} else {
		t.Logf("exec refused: %v", err)
	}
	_ = k.CoreV1().Pods(ns).Delete(context.Background(), "noexec", metav1.DeleteOptions{})
}

// testCrashRestart: the node is SIGKILLed with a pod running; its processes
// must not survive the next start, which sets the pod Failed (NodeRestarted).
func testCrashRestart(t *testing.T, c *cluster, bin string) {
	k := c.admin
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "survivor"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyAlways,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: []string{"sh", "-c", "sleep 2345 & wait"}}},
	}})
	waitPhase(t, k, "survivor", v1.PodRunning, 30*time.Second)
	time.Sleep(300 * time.Millisecond)
	c.killNode()
	c.startNode(bin)
	waitFor(t, 60*time.Second, "NodeRestarted", func() (bool, error) {
		p := getPod(t, k, "survivor")
		return p.Status.Phase == v1.PodFailed && p.Status.Reason == "NodeRestarted", nil
	})
	if out, _ := exec.Command("pgrep", "-f", "sleep 2345").Output(); len(out) > 0 {
		t.Errorf("processes of the crashed node's pod survived its restart: %s", out)
	}
	// The restarted node runs new pods.
	mkPod(t, k, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "after"}, Spec: v1.PodSpec{
		RestartPolicy: v1.RestartPolicyNever,
		Containers:    []v1.Container{{Name: "c", Image: "img", Command: []string{"true"}}},
	}})
	waitPhase(t, k, "after", v1.PodSucceeded, 30*time.Second)
}
