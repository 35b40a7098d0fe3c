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
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/runtime"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	corev1listers "k8s.io/client-go/listers/core/v1"
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

// serve runs the node until SIGTERM, SIGINT or SIGHUP (exit 0, after every pod
// is stopped) or until the node controller fails (exit 1). Each step is a
// function of steps.go; a step that fails is logged and the node exits 1.
func serve(cfg *config.Config) int {
	logger := setUpLogging(cfg.Verbose)
	if err := makeMountsPrivate(); err != nil {
		return fatal(logger, err)
	}
	client, apiPort, err := connect(cfg)
	if err != nil {
		return fatal(logger, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)

	version, err := waitForAPIServer(client, sigs)
	if errors.Is(err, errSignalled) {
		return 0
	} else if err != nil {
		return fatal(logger, err)
	}
	if err := cleanUpEarlierRun(ctx, cfg, client, logger); err != nil {
		return fatal(logger, err)
	}
	recorder, stopEvents := startEvents(client, cfg.NodeName)
	defer stopEvents()
	hn, err := newHostNode(cfg, client, recorder, version, apiPort, logger)
	if err != nil {
		return fatal(logger, err)
	}
	dnsServer, err := startDNS(cfg, hn)
	if err != nil {
		return fatal(logger, err)
	}
	defer dnsServer.Shutdown()

	stopNode := hn.start(ctx, cfg, logger)
	defer stopNode()
	code := waitForStop(sigs, hn, logger)
	hn.shutDown(sigs, stopNode, cfg.StateDir, logger)
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
