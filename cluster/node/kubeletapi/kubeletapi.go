// Package kubeletapi is the node's HTTPS API as the API server calls it:
// container logs (kubectl logs) and the pod list. Streaming endpoints (exec,
// attach, port-forward) answer with a clear refusal since there is no
// container runtime behind them. Callers are authenticated by the TLS layer:
// only client certificates signed by --client-ca get this far.
package kubeletapi

import (
	"fmt"
	"net/http"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// Handler builds the mux. logs serves containerLogs; pods lists the pods
// bound to the node.
func Handler(logs api.ContainerLogsHandlerFunc, running, bound api.PodListerFunc) http.Handler {
	mux := http.NewServeMux()
	for _, what := range []string{"exec", "attach", "portForward", "run"} {
		mux.HandleFunc("/"+what+"/", refuse(what))
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("/", api.PodHandler(api.PodHandlerConfig{
		GetContainerLogs:      logs,
		GetPods:               running,
		GetPodsFromKubernetes: bound,
	}, true))
	return mux
}

func refuse(what string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, fmt.Sprintf("%s is not supported by this node: it runs pods as host processes, without a container runtime to %s into; use `kubectl logs`", what, what), http.StatusNotImplemented)
	}
}
