// Package integration starts a throwaway etcd + kube-apiserver on loopback
// ports (from the binary named by FUSEFORGE_KUBE_BIN), runs the node against
// it and checks what pods see. Skipped when FUSEFORGE_KUBE_BIN is unset.
package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// cluster is what the test started; stop() ends every process by its pid.
type cluster struct {
	t        *testing.T
	dir      string
	procs    []*exec.Cmd
	apiURL   string
	admin    *kubernetes.Clientset
	adminCfg *rest.Config
	nodeCmd  *exec.Cmd
	stateDir string
	dnsAddr  string
}

type pki struct {
	caCert *x509.Certificate
	caKey  *ecdsa.PrivateKey
	dir    string
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

func newPKI(dir string) (*pki, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, _ := x509.ParseCertificate(der)
	if err := writePEM(filepath.Join(dir, "ca.crt"), "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return &pki{caCert: cert, caKey: key, dir: dir}, nil
}

// issue writes name.crt/name.key for a client or server certificate.
func (p *pki) issue(name, cn string, orgs []string, server bool) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.DNSNames = []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, p.caKey)
	if err != nil {
		return err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(p.dir, name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return writePEM(filepath.Join(p.dir, name+".key"), "EC PRIVATE KEY", kder)
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// freeDNSAddr finds a loopback address whose port 53 is free (UDP and TCP).
func freeDNSAddr(t *testing.T) string {
	for i := 0; i < 50; i++ {
		b, _ := rand.Int(rand.Reader, big.NewInt(200))
		addr := fmt.Sprintf("127.0.%d.%d:53", 100+i, 2+b.Int64())
		u, err := net.ListenPacket("udp", addr)
		if err != nil {
			continue
		}
		l, err := net.Listen("tcp", addr)
		u.Close()
		if err != nil {
			continue
		}
		l.Close()
		return addr
	}
	t.Fatal("no free loopback address for DNS")
	return ""
}

func writeKubeconfig(path, server, caFile, certFile, keyFile string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: server, CertificateAuthority: caFile}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{ClientCertificate: certFile, ClientKey: keyFile}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "c"
	return clientcmd.WriteToFile(*cfg, path)
}

func (c *cluster) start(name string, args ...string) *exec.Cmd {
	log, err := os.Create(filepath.Join(c.dir, name+".log"))
	if err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("starting %s: %v", name, err)
	}
	c.procs = append(c.procs, cmd)
	return cmd
}

// startCluster brings up etcd and the API server (Node,RBAC authorization,
// NodeRestriction) with freshly made certificates.
func startCluster(t *testing.T, kubeBin string) *cluster {
	dir, err := os.MkdirTemp("", "node-it-")
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, dir: dir}
	p, err := newPKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []struct {
		name, cn string
		orgs     []string
		server   bool
	}{
		{"apiserver", "kube-apiserver", nil, true},
		{"admin", "admin", []string{"system:masters"}, false},
		{"kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, false},
		{"node", "system:node:it-node", []string{"system:nodes"}, false},
		{"node-serving", "it-node", nil, true},
	} {
		if err := p.issue(x.name, x.cn, x.orgs, x.server); err != nil {
			t.Fatal(err)
		}
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err := writePEM(filepath.Join(dir, "sa.key"), "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(sa)); err != nil {
		t.Fatal(err)
	}
	if err := writePEM(filepath.Join(dir, "sa.pub"), "PUBLIC KEY", pub); err != nil {
		t.Fatal(err)
	}
	etcdPort, peerPort, apiPort := freePort(t), freePort(t), freePort(t)
	f := func(n string) string { return filepath.Join(dir, n) }
	c.start("etcd", kubeBin, "etcd", "--name", "it", "--data-dir", f("etcd"),
		"--listen-client-urls", "http://127.0.0.1:"+strconv.Itoa(etcdPort), "--advertise-client-urls", "http://127.0.0.1:"+strconv.Itoa(etcdPort),
		"--listen-peer-urls", "http://127.0.0.1:"+strconv.Itoa(peerPort), "--initial-advertise-peer-urls", "http://127.0.0.1:"+strconv.Itoa(peerPort),
		"--initial-cluster", "it=http://127.0.0.1:"+strconv.Itoa(peerPort), "--listen-metrics-urls", "")
	c.start("kube-apiserver", kubeBin, "kube-apiserver",
		"--etcd-servers", "http://127.0.0.1:"+strconv.Itoa(etcdPort),
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", strconv.Itoa(apiPort),
		"--tls-cert-file", f("apiserver.crt"), "--tls-private-key-file", f("apiserver.key"), "--client-ca-file", f("ca.crt"),
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", f("sa.pub"), "--service-account-signing-key-file", f("sa.key"),
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--kubelet-client-certificate", f("kubelet-client.crt"), "--kubelet-client-key", f("kubelet-client.key"),
		"--kubelet-certificate-authority", f("ca.crt"), "--kubelet-preferred-address-types", "InternalIP",
		"--service-cluster-ip-range", "10.96.0.0/16", "--cert-dir", f("apiserver-certs"))
	c.apiURL = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	if err := writeKubeconfig(f("admin.kubeconfig"), c.apiURL, f("ca.crt"), f("admin.crt"), f("admin.key")); err != nil {
		t.Fatal(err)
	}
	if err := writeKubeconfig(f("node.kubeconfig"), c.apiURL, f("ca.crt"), f("node.crt"), f("node.key")); err != nil {
		t.Fatal(err)
	}
	c.adminCfg, err = clientcmd.BuildConfigFromFlags("", f("admin.kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	c.admin = kubernetes.NewForConfigOrDie(c.adminCfg)
	deadline := time.Now().Add(90 * time.Second)
	for {
		body, err := c.admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		if err == nil && string(body) == "ok" {
			break
		}
		if time.Now().After(deadline) {
			c.stop()
			t.Fatalf("API server not ready: %v %s", err, body)
		}
		time.Sleep(300 * time.Millisecond)
	}
	return c
}

// startNode runs the node binary against the cluster.
func (c *cluster) startNode(bin string) {
	c.stateDir = filepath.Join(c.dir, "state")
	c.dnsAddr = freeDNSAddr(c.t)
	f := func(n string) string { return filepath.Join(c.dir, n) }
	log, _ := os.OpenFile(f("node.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	cmd := exec.Command(bin, "--kubeconfig", f("node.kubeconfig"), "--node-name", "it-node", "--state-dir", c.stateDir,
		"--cpus", "4", "--memory", "8Gi", "--gpus", "2", "--pods", "20",
		"--kubelet-address", "127.0.0.1:"+strconv.Itoa(freePort(c.t)),
		"--tls-cert", f("node-serving.crt"), "--tls-key", f("node-serving.key"), "--client-ca", f("ca.crt"),
		"--dns-address", c.dnsAddr, "--cluster-domain", "cluster.local", "--path", "/opt/it-bin",
		"--env", "IT_EXTRA=from-node")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.nodeCmd = cmd
}

// killNode simulates a crash: SIGKILL, no cleanup.
func (c *cluster) killNode() {
	_ = c.nodeCmd.Process.Kill()
	_ = c.nodeCmd.Wait()
	c.nodeCmd = nil
}

// stopNode sends SIGTERM and waits for a clean exit.
func (c *cluster) stopNode(timeout time.Duration) (int, error) {
	if c.nodeCmd == nil {
		return 0, nil
	}
	_ = c.nodeCmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- c.nodeCmd.Wait() }()
	select {
	case <-done:
	case <-time.After(timeout):
		_ = c.nodeCmd.Process.Kill()
		<-done
		c.nodeCmd = nil
		return -1, fmt.Errorf("node did not stop within %s", timeout)
	}
	code := c.nodeCmd.ProcessState.ExitCode()
	c.nodeCmd = nil
	return code, nil
}

// stop ends everything started, by pid, and removes the temp dir.
func (c *cluster) stop() {
	if c.nodeCmd != nil {
		_, _ = c.stopNode(60 * time.Second)
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		_ = p.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = p.Process.Kill()
			<-done
		}
	}
	if os.Getenv("FUSEFORGE_KEEP_IT_DIR") == "" {
		_ = os.RemoveAll(c.dir)
	} else {
		c.t.Logf("kept %s", c.dir)
	}
}
