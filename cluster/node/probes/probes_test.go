package probes

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

func TestCheck(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/bad" {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		if r.Header.Get("X-Probe") != "yes" {
			w.WriteHeader(http.StatusBadRequest)
		}
	}))
	defer srv.Close()
	_, portStr, _ := net.SplitHostPort(srv.Listener.Addr().String())
	port, _ := strconv.Atoi(portStr)
	c := &v1.Container{Name: "c", Ports: []v1.ContainerPort{{Name: "web", ContainerPort: int32(port)}}}
	hdr := []v1.HTTPHeader{{Name: "X-Probe", Value: "yes"}}
	ctx := context.Background()
	if ok, msg := Check(ctx, Handler{HTTPGet: &v1.HTTPGetAction{Path: "/", Port: intstr.FromString("web"), HTTPHeaders: hdr}}, c, time.Second, nil); !ok {
		t.Errorf("http by port name: %s", msg)
	}
	if ok, _ := Check(ctx, Handler{HTTPGet: &v1.HTTPGetAction{Path: "/bad", Port: intstr.FromInt32(int32(port)), HTTPHeaders: hdr}}, c, time.Second, nil); ok {
		t.Error("503 must fail")
	}
	if ok, msg := Check(ctx, Handler{TCPSocket: &v1.TCPSocketAction{Port: intstr.FromInt32(int32(port))}}, c, time.Second, nil); !ok {
		t.Errorf("tcp: %s", msg)
	}
	srv.Close()
	if ok, _ := Check(ctx, Handler{TCPSocket: &v1.TCPSocketAction{Port: intstr.FromInt32(int32(port))}}, c, time.Second, nil); ok {
		t.Error("tcp to a closed port must fail")
	}
	exec := func(_ context.Context, argv []string) ([]byte, int, error) {
		if argv[0] == "ok" {
			return nil, 0, nil
		}
		return []byte("nope"), 1, nil
	}
	if ok, _ := Check(ctx, Handler{Exec: &v1.ExecAction{Command: []string{"ok"}}}, c, time.Second, exec); !ok {
		t.Error("exec 0")
	}
	if ok, msg := Check(ctx, Handler{Exec: &v1.ExecAction{Command: []string{"no"}}}, c, time.Second, exec); ok || msg == "" {
		t.Error("exec 1")
	}
}

func TestWorkerThresholds(t *testing.T) {
	// Results: fail, fail, ok, fail, fail, fail ... with failureThreshold 3.
	seq := []bool{true, false, false, true, false, false, false}
	var mu sync.Mutex
	i := 0
	var reports []bool
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &Worker{
		Probe:   &v1.Probe{PeriodSeconds: 1, FailureThreshold: 3},
		Initial: false,
		tick:    10 * time.Millisecond,
		Check: func(context.Context, time.Duration) (bool, string) {
			mu.Lock()
			defer mu.Unlock()
			if i >= len(seq) {
				cancel()
				return false, ""
			}
			r := seq[i]
			i++
			return r, "x"
		},
		Report: func(ok bool, _ string) { mu.Lock(); reports = append(reports, ok); mu.Unlock() },
	}
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("worker did not stop")
	}
	mu.Lock()
	defer mu.Unlock()
	// ok -> true; two failures are below the threshold; ok; three failures -> false.
	if len(reports) != 2 || !reports[0] || reports[1] {
		t.Errorf("reports %v, want [true false]", reports)
	}
}
