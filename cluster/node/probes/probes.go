// Package probes runs startup, readiness and liveness probes the way the
// kubelet does (thresholds, periods, initial delay). Pods share the host's
// network, so httpGet, tcpSocket and grpc probes go to 127.0.0.1.
package probes

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// ExecFunc runs a command inside the container: output and exit code.
type ExecFunc func(ctx context.Context, argv []string) ([]byte, int, error)

// Handler is a probe or lifecycle-hook action.
type Handler struct {
	Exec      *v1.ExecAction
	HTTPGet   *v1.HTTPGetAction
	TCPSocket *v1.TCPSocketAction
	GRPC      *v1.GRPCAction
}

// FromProbe extracts a probe's action.
func FromProbe(p *v1.Probe) Handler {
	return Handler{Exec: p.Exec, HTTPGet: p.HTTPGet, TCPSocket: p.TCPSocket, GRPC: p.GRPC}
}

var httpClient = &http.Client{
	Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // probes never verify, as the kubelet
		DisableKeepAlives: true,
	},
	CheckRedirect: func(req *http.Request, via []*http.Request) error {
		if len(via) >= 10 {
			return http.ErrUseLastResponse
		}
		return nil
	},
}

// Check runs the action once within timeout; it reports success and a message.
func Check(ctx context.Context, h Handler, c *v1.Container, timeout time.Duration, exec ExecFunc) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case h.HTTPGet != nil:
		g := h.HTTPGet
		port, err := resolvePort(g.Port, c)
		if err != nil {
			return false, err.Error()
		}
		host := g.Host
		if host == "" {
			host = "127.0.0.1"
		}
		scheme := strings.ToLower(string(g.Scheme))
		if scheme == "" {
			scheme = "http"
		}
		path := g.Path
		if !strings.HasPrefix(path, "/") {
			path = "/" + path
		}
		u := &url.URL{Scheme: scheme, Host: net.JoinHostPort(host, strconv.Itoa(port))}
		full := u.String() + path
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, full, nil)
		if err != nil {
			return false, err.Error()
		}
		req.Header.Set("User-Agent", "kube-probe/host-process")
		req.Header.Set("Accept", "*/*")
		for _, hdr := range g.HTTPHeaders {
			if strings.EqualFold(hdr.Name, "host") {
				req.Host = hdr.Value
			} else {
				req.Header.Add(hdr.Name, hdr.Value)
			}
		}
		resp, err := httpClient.Do(req)
		if err != nil {
			return false, fmt.Sprintf("Get %q: %v", full, err)
		}
		resp.Body.Close()
		if resp.StatusCode >= 200 && resp.StatusCode < 400 {
			return true, ""
		}
		return false, fmt.Sprintf("HTTP probe failed with statuscode: %d", resp.StatusCode)
	case h.TCPSocket != nil:
		port, err := resolvePort(h.TCPSocket.Port, c)
		if err != nil {
			return false, err.Error()
		}
		host := h.TCPSocket.Host
		if host == "" {
			host = "127.0.0.1"
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return false, fmt.Sprintf("dial tcp %s:%d: %v", host, port, err)
		}
		conn.Close()
		return true, ""
	case h.GRPC != nil:
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(h.GRPC.Port)))
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return false, err.Error()
		}
		defer conn.Close()
		svc := ""
		if h.GRPC.Service != nil {
			svc = *h.GRPC.Service
		}
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			return false, fmt.Sprintf("failed to connect service %q within %v: %v", addr, timeout, err)
		}
		if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return false, fmt.Sprintf("service unhealthy (responded with %q)", resp.GetStatus())
		}
		return true, ""
	case h.Exec != nil:
		if exec == nil {
			return false, "exec probes need a running container"
		}
		out, code, err := exec(ctx, h.Exec.Command)
		if err != nil {
			return false, err.Error()
		}
		if code != 0 {
			return false, fmt.Sprintf("command %q exited with %d: %s", h.Exec.Command, code, strings.TrimSpace(string(out)))
		}
		return true, ""
	}
	return false, "probe has no action"
}

func resolvePort(p intstr.IntOrString, c *v1.Container) (int, error) {
	if p.Type == intstr.Int {
		return p.IntValue(), nil
	}
	if n, err := strconv.Atoi(p.StrVal); err == nil {
		return n, nil
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return int(cp.ContainerPort), nil
		}
	}
	return 0, fmt.Errorf("port %q not found in container %s", p.StrVal, c.Name)
}

// Worker runs one probe periodically and reports changes of its verdict.
type Worker struct {
	Probe *v1.Probe
	// Check runs the probe once.
	Check func(ctx context.Context, timeout time.Duration) (bool, string)
	// Report is called with each verdict that differs from the previous one
	// (the first verdict is compared with Initial).
	Report  func(ok bool, msg string)
	Initial bool
	// StopOnSuccess ends the worker after the first success (startup probes).
	StopOnSuccess bool
	// tick overrides the period (tests).
	tick time.Duration
}

func seconds(v int32, def int32) time.Duration {
	if v <= 0 {
		v = def
	}
	return time.Duration(v) * time.Second
}

// Run probes until ctx ends.
func (w *Worker) Run(ctx context.Context) {
	p := w.Probe
	period := seconds(p.PeriodSeconds, 10)
	if w.tick > 0 {
		period = w.tick
	}
	timeout := seconds(p.TimeoutSeconds, 1)
	failThreshold := int(p.FailureThreshold)
	if failThreshold <= 0 {
		failThreshold = 3
	}
	okThreshold := int(p.SuccessThreshold)
	if okThreshold <= 0 {
		okThreshold = 1
	}
	if p.InitialDelaySeconds > 0 {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(p.InitialDelaySeconds) * time.Second):
		}
	}
	verdict := w.Initial
	okRun, failRun := 0, 0
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		ok, msg := w.Check(ctx, timeout)
		if ctx.Err() != nil {
			return
		}
		if ok {
			okRun++
			failRun = 0
			if okRun >= okThreshold && !verdict {
				verdict = true
				w.Report(true, "")
			}
			if w.StopOnSuccess && verdict {
				return
			}
		} else {
			failRun++
			okRun = 0
			if failRun >= failThreshold && (verdict || failRun == failThreshold) {
				verdict = false
				w.Report(false, msg)
				failRun = 0
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
