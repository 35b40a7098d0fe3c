// Command node is a Kubernetes node for this machine: it registers a Node
// through virtual-kubelet, runs the pods bound to it as host processes (the
// image is this machine's environment), serves their logs to the API server,
// and answers cluster DNS.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/dns"
	"fuseforge.dev/cluster/node/kubeclient"
	"fuseforge.dev/cluster/node/kubeletapi"
	"fuseforge.dev/cluster/node/nodeinfo"
	"fuseforge.dev/cluster/node/provider"
	"fuseforge.dev/cluster/node/runtime"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vkslog "github.com/virtual-kubelet/virtual-kubelet/log/slog"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// nsMarker tells the re-executed node that it already runs in its own mount namespace.
const nsMarker = "FUSEFORGE_NODE_PRIVATE_MOUNTS"

func main() {
	if len(os.Args) > 2 && os.Args[1] == runtime.SubcommandName {
		runtime.ChildMain(os.Args[2])
		return
	}
	cfg, err := config.Parse(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "node:", err)
		os.Exit(2)
	}
	if os.Getenv(nsMarker) != "1" {
		os.Exit(reexecInPrivateMountNamespace())
	}
	os.Unsetenv(nsMarker)
	os.Exit(serve(cfg))
}

// reexecInPrivateMountNamespace runs the node again in a mount namespace of
// its own: the pods' tmpfs mounts then live and die with the node, and never
// show on the host even if the node is killed. This process only relays
// signals and the exit status.
func reexecInPrivateMountNamespace() int {
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Env = append(os.Environ(), nsMarker+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "node: starting in a private mount namespace (needs root):", err)
		return 1
	}
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err := cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
		if ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ws.ExitStatus()
	}
	if err != nil {
		return 1
	}
	return 0
}

func serve(cfg *config.Config) int {
	level := slog.LevelInfo
	if cfg.Verbose {
		level = slog.LevelDebug
	}
	logger := slog.New(quietConflicts{Handler: slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})})
	slog.SetDefault(logger)
	vklog.L = vkslog.FromSlog(logger)
	klog.SetSlogLogger(logger)
	fatal := func(msg string, err error) int {
		logger.Error(msg, "err", err)
		return 1
	}
	// Mounts made here must not reach the host; the host's still reach us.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return fatal("making the node's mounts private", err)
	}

	restCfg, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return fatal("reading --kubeconfig", err)
	}
	restCfg.UserAgent = "fuseforge-node/" + cfg.NodeName
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return fatal("building client", err)
	}
	apiPort := "443"
	if u, err := url.Parse(restCfg.Host); err == nil && u.Port() != "" {
		apiPort = u.Port()
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)

	version := ""
	for i := 0; ; i++ {
		v, err := client.Discovery().ServerVersion()
		if err == nil {
			version = v.GitVersion
			break
		}
		if i == 60 {
			return fatal("API server not reachable", err)
		}
		select {
		case <-sigs:
			return 0
		case <-time.After(time.Second):
		}
	}

	if err := provider.CleanStateDir(cfg.StateDir); err != nil {
		return fatal("cleaning the state dir", err)
	}
	if n, err := provider.MarkOrphans(ctx, client, cfg.NodeName); err != nil {
		logger.Warn("marking pods of an earlier run as failed", "err", err)
	} else if n > 0 {
		logger.Info("pods of an earlier run of this node set Failed (NodeRestarted)", "count", n)
	}

	eb := record.NewBroadcaster()
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.CoreV1().Events("")})
	defer eb.Shutdown()
	recorder := eb.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: cfg.NodeName})

	nodeSpec := nodeinfo.Build(cfg, version+"-hostprocess")
	var prov *provider.Provider
	var podLister corev1listers.PodLister
	var svcLister corev1listers.ServiceLister
	var handler http.Handler
	newProvider := func(pc nodeutil.ProviderConfig) (nodeutil.Provider, node.NodeProvider, error) {
		podLister, svcLister = pc.Pods, pc.Services
		prov = provider.New(provider.Config{
			Node: cfg, Client: client, Pods: pc.Pods, Services: pc.Services, Recorder: recorder,
			Allocatable: nodeSpec.Status.Allocatable, APIPort: apiPort, HostPath: os.Getenv("PATH"), Log: logger,
		})
		return prov, nil, nil
	}
	// nodeutil builds a default client from $KUBECONFIG before our options
	// replace it; point it at ours so it does not warn about in-cluster config.
	os.Setenv("KUBECONFIG", cfg.Kubeconfig)
	n, err := nodeutil.NewNode(cfg.NodeName, newProvider,
		nodeutil.WithClient(kubeclient.ForNodeUtil(client)),
		nodeutil.WithTLSConfig(
			nodeutil.WithKeyPairFromPath(cfg.TLSCert, cfg.TLSKey),
			nodeutil.WithCAFromPath(cfg.ClientCA),
		),
		func(c *nodeutil.NodeConfig) error {
			c.NodeSpec = nodeSpec
			c.HTTPListenAddr = cfg.KubeletAddress
			c.SkipDownwardAPIResolution = true
			c.EventRecorder = recorder
			c.NumWorkers = 4
			c.InformerResyncPeriod = time.Minute
			c.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handler.ServeHTTP(w, r) })
			return nil
		},
	)
	if err != nil {
		return fatal("setting up the node", err)
	}
	handler = kubeletapi.Handler(prov.GetContainerLogs, prov.GetPods, prov.PodsFromKubernetes)

	dnsServer := &dns.Server{
		Domain:   cfg.ClusterDomain,
		Lookup:   listerLookup{pods: podLister, services: svcLister},
		Upstream: upstreamResolver(cfg.DNSIP),
		Timeout:  2 * time.Second,
	}
	if err := dnsServer.ListenAndServe(cfg.DNSAddress); err != nil {
		return fatal("starting cluster DNS on "+cfg.DNSAddress, err)
	}
	defer dnsServer.Shutdown()

	nodeCtx, stopNode := context.WithCancel(ctx)
	defer stopNode()
	go func() { _ = n.Run(nodeCtx) }()
	readyCtx, readyCancel := context.WithTimeout(ctx, 2*time.Minute)
	go func() {
		defer readyCancel()
		if err := n.WaitReady(readyCtx, 0); err == nil {
			logger.Info("node ready", "node", cfg.NodeName, "kubelet", cfg.KubeletAddress, "dns", cfg.DNSAddress,
				"cpu", cfg.CPUs.String(), "memory", cfg.Memory.String(), "gpus", cfg.GPUs, "kubeletVersion", nodeSpec.Status.NodeInfo.KubeletVersion)
		}
	}()

	code := 0
	select {
	case s := <-sigs:
		logger.Info("stopping: terminating pods", "signal", s.String())
	case <-n.Done():
		logger.Error("node controller stopped", "err", n.Err())
		code = 1
	}
	go func() {
		for s := range sigs {
			logger.Info("already stopping; waiting for pods' grace periods", "signal", s.String())
		}
	}()
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Minute)
	prov.Shutdown(sctx)
	scancel()
	stopNode()
	select {
	case <-n.Done():
	case <-time.After(10 * time.Second):
	}
	if err := os.RemoveAll(filepath.Join(cfg.StateDir, "pods")); err != nil {
		logger.Warn("removing pod directories", "err", err)
	}
	logger.Info("node stopped")
	return code
}

// upstreamResolver is the host's first nameserver, unless that is our own address.
func upstreamResolver(self net.IP) string {
	ns := runtime.FirstNameserver(runtime.HostFile("/etc/resolv.conf"))
	if ns == "" || ns == self.String() {
		return ""
	}
	if strings.Contains(ns, ":") && !strings.HasPrefix(ns, "[") {
		return "[" + ns + "]:53"
	}
	return ns + ":53"
}

// listerLookup answers DNS from the informer caches the node already keeps.
type listerLookup struct {
	pods     corev1listers.PodLister
	services corev1listers.ServiceLister
}

func (l listerLookup) Service(ns, name string) (*v1.Service, bool) {
	s, err := l.services.Services(ns).Get(name)
	return s, err == nil
}

func (l listerLookup) PodsWithSubdomain(ns, sub string) []*v1.Pod {
	all, err := l.pods.Pods(ns).List(labels.Everything())
	if err != nil {
		return nil
	}
	var out []*v1.Pod
	for _, p := range all {
		if strings.EqualFold(p.Spec.Subdomain, sub) && p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

// quietConflicts demotes the pod controller's optimistic-concurrency
// conflicts (retried at once, harmless) to debug: they would otherwise fill
// the node log with stack traces. virtual-kubelet attaches the error with
// With(), so it is seen in WithAttrs.
type quietConflicts struct {
	slog.Handler
	conflict bool
}

func isConflict(a slog.Attr) bool {
	return strings.Contains(a.Value.String(), "the object has been modified")
}

func (q quietConflicts) Handle(ctx context.Context, r slog.Record) error {
	conflict := q.conflict
	r.Attrs(func(a slog.Attr) bool {
		conflict = conflict || isConflict(a)
		return !conflict
	})
	if conflict && r.Level > slog.LevelDebug {
		if !q.Handler.Enabled(ctx, slog.LevelDebug) {
			return nil
		}
		r.Level = slog.LevelDebug
	}
	return q.Handler.Handle(ctx, r)
}

func (q quietConflicts) WithAttrs(as []slog.Attr) slog.Handler {
	c := q.conflict
	for _, a := range as {
		c = c || isConflict(a)
	}
	return quietConflicts{q.Handler.WithAttrs(as), c}
}

func (q quietConflicts) WithGroup(n string) slog.Handler {
	return quietConflicts{q.Handler.WithGroup(n), q.conflict}
}
