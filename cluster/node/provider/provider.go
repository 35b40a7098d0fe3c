// Package provider is the virtual-kubelet provider that runs each pod bound
// to this node as a group of host processes (see runtime), and reports their
// state back as pod status.
package provider

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/gpu"
	"fuseforge.dev/cluster/node/logs"
	"fuseforge.dev/cluster/node/volumes"
	dto "github.com/prometheus/client_model/go"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/record"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// Config wires the provider to the cluster.
type Config struct {
	Node        *config.Config
	Client      kubernetes.Interface
	Pods        corev1listers.PodLister
	Services    corev1listers.ServiceLister
	Recorder    record.EventRecorder
	Allocatable v1.ResourceList
	// APIPort is the API server's port, for KUBERNETES_SERVICE_PORT.
	APIPort string
	// HostPath is the node's own PATH, appended after --path.
	HostPath string
	Log      *slog.Logger
}

// Provider implements nodeutil.Provider and node.PodNotifier.
type Provider struct {
	cfg     Config
	gpus    *gpu.Allocator
	mat     *volumes.Materialiser
	podsDir string

	mu       sync.Mutex
	pods     map[string]*podRunner
	notify   func(*v1.Pod)
	shutdown bool
}

// New makes a provider.
func New(cfg Config) *Provider {
	src := apiSources{client: cfg.Client}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Provider{
		cfg:     cfg,
		gpus:    gpu.New(cfg.Node.GPUs),
		mat:     &volumes.Materialiser{Sources: src, Tokens: src, Allocatable: cfg.Allocatable},
		podsDir: filepath.Join(cfg.Node.StateDir, "pods"),
		pods:    map[string]*podRunner{},
	}
}

func key(ns, name string) string { return ns + "/" + name }

// NotifyPods registers the callback through which status changes reach the API server.
func (p *Provider) NotifyPods(_ context.Context, f func(*v1.Pod)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = f
}

func (p *Provider) notifier() func(*v1.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.notify
}

// CreatePod starts running pod; it returns at once, the pod's life goes on in
// its own goroutine.
func (p *Provider) CreatePod(_ context.Context, pod *v1.Pod) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shutdown {
		return fmt.Errorf("node is shutting down")
	}
	k := key(pod.Namespace, pod.Name)
	if old, ok := p.pods[k]; ok {
		if old.uid() == string(pod.UID) {
			return nil
		}
		// The previous pod of that name is still being torn down: retry later.
		return fmt.Errorf("pod %s: a previous pod with this name is still terminating", k)
	}
	r := newRunner(p, pod.DeepCopy())
	p.pods[k] = r
	go r.run()
	return nil
}

// UpdatePod takes the new spec/metadata (labels, annotations,
// activeDeadlineSeconds); containers are not restarted for it.
func (p *Provider) UpdatePod(_ context.Context, pod *v1.Pod) error {
	r := p.get(pod.Namespace, pod.Name)
	if r == nil || r.uid() != string(pod.UID) {
		return errdefs.NotFoundf("pod %s/%s is not on this node", pod.Namespace, pod.Name)
	}
	r.update(pod.DeepCopy())
	return nil
}

// DeletePod starts the graceful termination of pod (SIGTERM, the grace
// period, SIGKILL) and returns; the terminal status follows through NotifyPods.
func (p *Provider) DeletePod(_ context.Context, pod *v1.Pod) error {
	r := p.get(pod.Namespace, pod.Name)
	if r == nil {
		return errdefs.NotFoundf("pod %s/%s is not on this node", pod.Namespace, pod.Name)
	}
	r.delete(gracePeriod(pod))
	return nil
}

// gracePeriod is the deletion's grace period, else the pod's, else 30 s.
func gracePeriod(pod *v1.Pod) time.Duration {
	if pod.DeletionGracePeriodSeconds != nil {
		return time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second
	}
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		return time.Duration(*pod.Spec.TerminationGracePeriodSeconds) * time.Second
	}
	return 30 * time.Second
}

func (p *Provider) get(ns, name string) *podRunner {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pods[key(ns, name)]
}

func (p *Provider) forget(r *podRunner) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pods[r.key] == r {
		delete(p.pods, r.key)
	}
}

// GetPod returns the pod with the node's view of its status.
func (p *Provider) GetPod(_ context.Context, ns, name string) (*v1.Pod, error) {
	r := p.get(ns, name)
	if r == nil {
		return nil, errdefs.NotFoundf("pod %s/%s is not on this node", ns, name)
	}
	return r.snapshot(), nil
}

// GetPodStatus returns the node's view of the pod's status.
func (p *Provider) GetPodStatus(ctx context.Context, ns, name string) (*v1.PodStatus, error) {
	pod, err := p.GetPod(ctx, ns, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

// GetPods lists every pod the node runs.
func (p *Provider) GetPods(context.Context) ([]*v1.Pod, error) {
	p.mu.Lock()
	rs := make([]*podRunner, 0, len(p.pods))
	for _, r := range p.pods {
		rs = append(rs, r)
	}
	p.mu.Unlock()
	out := make([]*v1.Pod, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.snapshot())
	}
	return out, nil
}

// PodsFromKubernetes lists the pods bound to this node, for the kubelet API's /pods.
func (p *Provider) PodsFromKubernetes(context.Context) ([]*v1.Pod, error) {
	return p.cfg.Pods.List(labels.Everything())
}

// GetContainerLogs serves `kubectl logs` from the container's log file.
func (p *Provider) GetContainerLogs(ctx context.Context, ns, podName, containerName string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	r := p.get(ns, podName)
	if r == nil {
		return nil, errdefs.NotFoundf("pod %s/%s is not on this node", ns, podName)
	}
	path, finished, err := r.logFile(containerName, opts.Previous)
	if err != nil {
		return nil, err
	}
	lo := logs.Options{Tail: -1, LimitBytes: int64(opts.LimitBytes), Timestamps: opts.Timestamps, Follow: opts.Follow}
	if opts.Tail > 0 {
		lo.Tail = opts.Tail
	}
	if opts.SinceSeconds > 0 {
		lo.Since = time.Now().Add(-time.Duration(opts.SinceSeconds) * time.Second)
	} else if !opts.SinceTime.IsZero() {
		lo.Since = opts.SinceTime
	}
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(logs.Read(ctx, path, lo, finished, pw))
	}()
	return pr, nil
}

const noStreams = "this node runs pods as host processes and does not support %s; use `kubectl logs`"

// RunInContainer refuses: there is no container runtime to exec into.
func (p *Provider) RunInContainer(context.Context, string, string, string, []string, api.AttachIO) error {
	return errdefs.InvalidInputf(noStreams, "exec")
}

// AttachToContainer refuses, as exec.
func (p *Provider) AttachToContainer(context.Context, string, string, string, api.AttachIO) error {
	return errdefs.InvalidInputf(noStreams, "attach")
}

// PortForward refuses: pods already listen on the host's loopback.
func (p *Provider) PortForward(context.Context, string, string, int32, io.ReadWriteCloser) error {
	return errdefs.InvalidInputf(noStreams, "port-forward (pods listen on 127.0.0.1 directly)")
}

// GetStatsSummary is not implemented (no cgroup accounting).
func (p *Provider) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return nil, errdefs.NotFound("stats are not collected by this node")
}

// GetMetricsResource is not implemented.
func (p *Provider) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, errdefs.NotFound("metrics are not collected by this node")
}

// Shutdown stops every pod the way a deletion would (SIGTERM, grace period,
// SIGKILL), reports them Failed with reason NodeShutdown straight to the API
// server, and removes their directories.
func (p *Provider) Shutdown(ctx context.Context) {
	p.mu.Lock()
	p.shutdown = true
	rs := make([]*podRunner, 0, len(p.pods))
	for _, r := range p.pods {
		rs = append(rs, r)
	}
	p.mu.Unlock()
	for _, r := range rs {
		r.shutdownNode(gracePeriod(r.snapshot()))
	}
	for _, r := range rs {
		select {
		case <-r.done:
		case <-ctx.Done():
		}
	}
	// Report directly: the pod controller's queues are being stopped.
	uctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, r := range rs {
		final := r.snapshot()
		cur, err := p.cfg.Client.CoreV1().Pods(final.Namespace).Get(uctx, final.Name, metav1.GetOptions{})
		if err != nil || cur.UID != final.UID || cur.Status.Phase == v1.PodSucceeded || cur.Status.Phase == v1.PodFailed {
			continue
		}
		cur.Status = final.Status
		if _, err := p.cfg.Client.CoreV1().Pods(cur.Namespace).UpdateStatus(uctx, cur, metav1.UpdateOptions{}); err != nil && !apierrors.IsNotFound(err) {
			p.cfg.Log.Warn("reporting pod status at shutdown", "pod", r.key, "err", err)
		}
	}
}

// deleteFromAPI finishes a deletion once the pod's processes are gone, as
// the kubelet does, instead of waiting out the whole grace period.
func (p *Provider) deleteFromAPI(pod *v1.Pod) {
	ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
	defer cancel()
	opts := metav1.DeleteOptions{GracePeriodSeconds: new(int64), Preconditions: metav1.NewUIDPreconditions(string(pod.UID))}
	err := p.cfg.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opts)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		p.cfg.Log.Warn("deleting terminated pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
	}
}
