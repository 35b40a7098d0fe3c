package config

import (
	"io"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	args := append(strings.Fields(`--kubeconfig k --node-name n1 --state-dir /tmp/st --cpus 8 --memory 16Gi --gpus 2 --pods 30
		--kubelet-address 127.0.0.1:10250 --tls-cert c --tls-key k --client-ca ca --dns-address 127.0.0.10:53
		--cluster-domain Cluster.Local. --path /venv/bin:/opt/bin --env A=1 --env B=x=y`),
		"--entrypoint", "ghcr.io/org/=python", "--entrypoint", "ghcr.io/org/flyte=pyflyte",
		"--workdir", "ghcr.io/org/=/home/app", "--workdir", "ghcr.io/org/flyte=/home/flyte", "--traversable", "/root/")
	c, err := Parse(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.CPUs.String() != "8" || c.Memory.String() != "16Gi" || c.GPUs != 2 || c.Pods != 30 || c.KubeletPort != 10250 {
		t.Errorf("resources/port: %+v", c)
	}
	if c.ClusterDomain != "cluster.local" || c.DNSIP.String() != "127.0.0.10" || c.Path != "/venv/bin:/opt/bin" {
		t.Errorf("dns/path: %q %v %q", c.ClusterDomain, c.DNSIP, c.Path)
	}
	if got := c.EntrypointFor("ghcr.io/org/flyte:v1"); len(got) != 1 || got[0] != "pyflyte" {
		t.Errorf("longest prefix wins: %v", got)
	}
	if got := c.EntrypointFor("ghcr.io/org/other"); len(got) != 1 || got[0] != "python" {
		t.Errorf("prefix: %v", got)
	}
	if c.EntrypointFor("docker.io/x") != nil {
		t.Error("no match")
	}
	if c.WorkdirFor("ghcr.io/org/flyte:v1") != "/home/flyte" || c.WorkdirFor("ghcr.io/org/x") != "/home/app" || c.WorkdirFor("x") != "" {
		t.Errorf("workdir: %+v", c.Workdirs)
	}
	if len(c.Traversable) != 1 || c.Traversable[0] != "/root" {
		t.Errorf("traversable: %v", c.Traversable)
	}
	if len(c.Env) != 2 || c.Env[1].Key != "B" || c.Env[1].Value != "x=y" {
		t.Errorf("env: %+v", c.Env)
	}
}

func TestParseErrors(t *testing.T) {
	base := "--kubeconfig k --node-name n --state-dir /tmp/s --tls-cert c --tls-key k --client-ca ca"
	for _, extra := range []string{
		"--dns-address 10.0.0.1:53", "--entrypoint noequals", "--workdir img=relative", "--traversable rel", "--env =v", "--memory lots", "--kubelet-address nope",
	} {
		if _, err := Parse(strings.Fields(base+" "+extra), io.Discard); err == nil {
			t.Errorf("%s: want an error", extra)
		}
	}
	if _, err := Parse([]string{"--node-name", "n"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--kubeconfig is required") {
		t.Errorf("missing flags: %v", err)
	}
	if _, err := Parse(strings.Fields("--kubeconfig k --node-name n --state-dir /tmp/a,b --tls-cert c --tls-key k --client-ca ca"), io.Discard); err == nil {
		t.Error("a state dir with a comma cannot be an overlay option")
	}
}
