package main

// The steps of serve (main.go), in the order it takes them.

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/dns"
	"fuseforge.dev/cluster/node/kubeclient"
	"fuseforge.dev/cluster/node/kubeletapi"
	"fuseforge.dev/cluster/node/nodeinfo"
	"fuseforge.dev/cluster/node/provider"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vkslog "github.com/virtual-kubelet/virtual-kubelet/log/slog"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// stepError is a step that failed: what the node was doing, and why.
type stepError struct {
	step string
	err  error
}

func (e *stepError) Error() string { return e.step + ": " + e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }

// fatal logs a failed step (its name as the message, the cause as "err") and
// returns the node's exit code, 1.
func fatal(logger *slog.Logger, err error) int {
	var s *stepError
	if errors.As(err, &s) {
		logger.Error(s.step, "err", s.err)
	} else {
		logger.Error("node failed", "err", err)
	}
	return 1
}

// errSignalled: a stop signal came before the node started; serve exits 0.
var errSignalled = errors.New("stop signal received")

// setUpLogging sends the node's, virtual-kubelet's and client-go's logs to one
// text logger on stderr (debug with -v), with update conflicts demoted to debug.
func setUpLogging(verbose bool) *slog.Logger {
	level := slog.LevelInfo
	if verbose {
		level = slog.LevelDebug
	}
	logger := slog.New(quietConflicts{Handler: slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})})
	slog.SetDefault(logger)
	vklog.L = vkslog.FromSlog(logger)
	klog.SetSlogLogger(logger)
	return logger
}

// makeMountsPrivate: mounts made here must not reach the host; the host's
// still reach us.
func makeMountsPrivate() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return &stepError{"making the node's mounts private", err}
	}
	return nil
}

// connect builds the API client from --kubeconfig; apiPort is the API
// server's port, which pods get as KUBERNETES_SERVICE_PORT.
func connect(cfg *config.Config) (client *kubernetes.Clientset, apiPort string, err error) {
	restCfg, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return nil, "", &stepError{"reading --kubeconfig", err}
	}
	restCfg.UserAgent = "fuseforge-node/" + cfg.NodeName
	client, err = kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, "", &stepError{"building client", err}
	}
	apiPort = "443"
	if u, err := url.Parse(restCfg.Host); err == nil && u.Port() != "" {
		apiPort = u.Port()
	}
	return client, apiPort, nil
}

// waitForAPIServer asks the API server for its version once a second, for
// about a minute; errSignalled if a stop signal comes first.
func waitForAPIServer(client kubernetes.Interface, sigs <-chan os.Signal) (string, error) {
	for i := 0; ; i++ {
		v, err := client.Discovery().ServerVersion()
		if err == nil {
			return v.GitVersion, nil
		}
		if i == 60 {
			return "", &stepError{"API server not reachable", err}
		}
		select {
		case <-sigs:
			return "", errSignalled
		case <-time.After(time.Second):
		}
	}
}

// cleanUpEarlierRun kills and removes what a crashed earlier run left in the
// state dir and sets the pods it had started Failed (NodeRestarted).
func cleanUpEarlierRun(ctx context.Context, cfg *config.Config, client kubernetes.Interface, logger *slog.Logger) error {
	if err := provider.CleanStateDir(cfg.StateDir); err != nil {
		return &stepError{"cleaning the state dir", err}
	}
	if n, err := provider.MarkOrphans(ctx, client, cfg.NodeName); err != nil {
		logger.Warn("marking pods of an earlier run as failed", "err", err)
	} else if n > 0 {
		logger.Info("pods of an earlier run of this node set Failed (NodeRestarted)", "count", n)
	}
	return nil
}

// startEvents records Events as the node's kubelet; stop flushes and ends it.
func startEvents(client kubernetes.Interface, nodeName string) (recorder record.EventRecorder, stop func()) {
	eb := record.NewBroadcaster()
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return eb.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: nodeName}), eb.Shutdown
}

// hostNode is the Node this process registers: virtual-kubelet's node
// controller, our provider that runs its pods, and the informer caches
// (pods, Services) that cluster DNS answers from.
type hostNode struct {
	node     *nodeutil.Node
	provider *provider.Provider
	spec     v1.Node
	pods     corev1listers.PodLister
	services corev1listers.ServiceLister
}

// newHostNode sets up (does not start) the node controller with our provider,
// the kubelet HTTPS API (logs, pod lists) and the Node object to register.
func newHostNode(cfg *config.Config, client kubernetes.Interface, recorder record.EventRecorder, version, apiPort string,
	logger *slog.Logger) (*hostNode, error) {
	h := &hostNode{spec: nodeinfo.Build(cfg, version+"-hostprocess")}
	var handler http.Handler
	newProvider := func(pc nodeutil.ProviderConfig) (nodeutil.Provider, node.NodeProvider, error) {
		h.pods, h.services = pc.Pods, pc.Services
		h.provider = provider.New(provider.Config{
			Node: cfg, Client: client, Pods: pc.Pods, Services: pc.Services, Recorder: recorder,
			Allocatable: h.spec.Status.Allocatable, APIPort: apiPort, HostPath: os.Getenv("PATH"), Log: logger,
		})
		return h.provider, nil, nil
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
			c.NodeSpec = h.spec
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
		return nil, &stepError{"setting up the node", err}
	}
	h.node = n
	handler = kubeletapi.Handler(h.provider.GetContainerLogs, h.provider.GetPods, h.provider.PodsFromKubernetes)
	return h, nil
}

// startDNS serves cluster DNS on --dns-address from the node's informer caches.
func startDNS(cfg *config.Config, h *hostNode) (*dns.Server, error) {
	server := &dns.Server{
		Domain:   cfg.ClusterDomain,
		Lookup:   listerLookup{pods: h.pods, services: h.services},
		Upstream: upstreamResolver(cfg.DNSIP),
		Timeout:  2 * time.Second,
	}
	if err := server.ListenAndServe(cfg.DNSAddress); err != nil {
		return nil, &stepError{"starting cluster DNS on " + cfg.DNSAddress, err}
	}
	return server, nil
}

// start runs the node controller (registers the Node, serves the kubelet API,
// syncs pods) until stop is called, and logs "node ready" once the Node is
// Ready (if within 2 minutes).
func (h *hostNode) start(ctx context.Context, cfg *config.Config, logger *slog.Logger) (stop context.CancelFunc) {
	nodeCtx, stop := context.WithCancel(ctx)
	go func() { _ = h.node.Run(nodeCtx) }()
	readyCtx, readyCancel := context.WithTimeout(ctx, 2*time.Minute)
	go func() {
		defer readyCancel()
		if err := h.node.WaitReady(readyCtx, 0); err == nil {
			logger.Info("node ready", "node", cfg.NodeName, "kubelet", cfg.KubeletAddress, "dns", cfg.DNSAddress,
				"cpu", cfg.CPUs.String(), "memory", cfg.Memory.String(), "gpus", cfg.GPUs, "kubeletVersion", h.spec.Status.NodeInfo.KubeletVersion)
		}
	}()
	return stop
}

// waitForStop blocks until a stop signal (exit code 0) or until the node
// controller stops by itself (1).
func waitForStop(sigs <-chan os.Signal, h *hostNode, logger *slog.Logger) int {
	select {
	case s := <-sigs:
		logger.Info("stopping: terminating pods", "signal", s.String())
		return 0
	case <-h.node.Done():
		logger.Error("node controller stopped", "err", h.node.Err())
		return 1
	}
}

// shutDown stops every pod as on deletion (their grace periods, 10 minutes at
// most), then the node controller (10 s at most), and removes the pods'
// directories. Further signals are only logged.
func (h *hostNode) shutDown(sigs <-chan os.Signal, stopNode context.CancelFunc, stateDir string, logger *slog.Logger) {
	go func() {
		for s := range sigs {
			logger.Info("already stopping; waiting for pods' grace periods", "signal", s.String())
		}
	}()
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Minute)
	h.provider.Shutdown(sctx)
	scancel()
	stopNode()
	select {
	case <-h.node.Done():
	case <-time.After(10 * time.Second):
	}
	if err := os.RemoveAll(filepath.Join(stateDir, "pods")); err != nil {
		logger.Warn("removing pod directories", "err", err)
	}
	logger.Info("node stopped")
}
