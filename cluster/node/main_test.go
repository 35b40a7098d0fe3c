package main

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

func TestFatalLogsTheStepAndItsCause(t *testing.T) {
	var out bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&out, nil))
	if code := fatal(logger, &stepError{"reading --kubeconfig", errors.New("no such file")}); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	if got := out.String(); !strings.Contains(got, `msg="reading --kubeconfig" err="no such file"`) {
		t.Fatalf("log line %q", got)
	}
}

func clientFor(t *testing.T, host string) kubernetes.Interface {
	t.Helper()
	client, err := kubernetes.NewForConfig(&rest.Config{Host: host})
	if err != nil {
		t.Fatal(err)
	}
	return client
}

func TestWaitForAPIServerReturnsItsVersion(t *testing.T) {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"major":"1","minor":"34","gitVersion":"v1.34.4"}`))
	}))
	defer api.Close()
	version, err := waitForAPIServer(clientFor(t, api.URL), make(chan os.Signal))
	if err != nil || version != "v1.34.4" {
		t.Fatalf("got %q, %v", version, err)
	}
}

func TestWaitForAPIServerStopsOnASignal(t *testing.T) {
	api := httptest.NewServer(http.NotFoundHandler())
	url := api.URL
	api.Close() // nothing listens there any more
	sigs := make(chan os.Signal, 1)
	sigs <- syscall.SIGTERM
	if _, err := waitForAPIServer(clientFor(t, url), sigs); !errors.Is(err, errSignalled) {
		t.Fatalf("got %v, want errSignalled", err)
	}
}
