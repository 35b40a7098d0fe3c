// Package config parses the node's command line. The flag names are a contract
// with scripts/cluster.sh, so they are kept exactly as that script passes them.
package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Config is everything the node needs to know about itself.
type Config struct {
	Kubeconfig     string
	NodeName       string
	StateDir       string
	CPUs           resource.Quantity
	Memory         resource.Quantity
	GPUs           int
	Pods           int
	KubeletAddress string
	KubeletPort    int32
	TLSCert        string
	TLSKey         string
	ClientCA       string
	DNSAddress     string
	DNSIP          net.IP
	ClusterDomain  string
	// Path is prepended to the host PATH in every container: it is how "the
	// image" (the project's virtualenv) comes first.
	Path string
	// Entrypoints maps image prefixes to the argv that stands in for the image's
	// ENTRYPOINT when a container gives args but no command.
	Entrypoints []Entrypoint
	// Workdirs maps image prefixes to the WORKDIR (and HOME) of that image's
	// user: a container of such an image that names no workingDir starts there,
	// in a directory its user owns, as in an image whose WORKDIR belongs to it.
	Workdirs []Workdir
	// Traversable directories get o+x inside every container (not on the host):
	// "the image" is this machine's environment, whose interpreter may live under
	// a home directory that other users cannot enter (/root/.pyenv).
	Traversable []string
	// Env is added to every container before the container's own env.
	Env []KV
	// Verbose turns on debug logging.
	Verbose bool
}

// Entrypoint is one --entrypoint IMAGE_PREFIX=EXECUTABLE.
type Entrypoint struct {
	Prefix string
	Argv   []string
}

// Workdir is one --workdir IMAGE_PREFIX=DIR.
type Workdir struct {
	Prefix string
	Dir    string
}

// KV is one --env KEY=VALUE.
type KV struct{ Key, Value string }

type listFlag struct{ values *[]string }

func (l listFlag) String() string     { return "" }
func (l listFlag) Set(v string) error { *l.values = append(*l.values, v); return nil }

// Parse reads the command line (without the program name).
func Parse(args []string, errOut io.Writer) (*Config, error) {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	fs.SetOutput(errOut)
	c := &Config{}
	var cpus, memory string
	var entrypoints, envs, workdirs, traversable []string
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig with the node's client credentials (CN system:node:NAME)")
	fs.StringVar(&c.NodeName, "node-name", "", "name of the Node object to register")
	fs.StringVar(&c.StateDir, "state-dir", "", "directory for pod volumes, container overlays and logs")
	fs.StringVar(&cpus, "cpus", "", "CPU capacity to advertise (default: this machine's CPUs)")
	fs.StringVar(&memory, "memory", "", "memory capacity to advertise, e.g. 16Gi (default: this machine's memory)")
	fs.IntVar(&c.GPUs, "gpus", 0, "nvidia.com/gpu count to advertise")
	fs.IntVar(&c.Pods, "pods", 110, "pod capacity to advertise")
	fs.StringVar(&c.KubeletAddress, "kubelet-address", "127.0.0.1:10250", "address of the kubelet HTTPS API (logs)")
	fs.StringVar(&c.TLSCert, "tls-cert", "", "serving certificate of the kubelet API")
	fs.StringVar(&c.TLSKey, "tls-key", "", "serving key of the kubelet API")
	fs.StringVar(&c.ClientCA, "client-ca", "", "CA that signs the client certificates allowed to call the kubelet API")
	fs.StringVar(&c.DNSAddress, "dns-address", "127.0.0.10:53", "loopback address of the cluster DNS server (UDP and TCP)")
	fs.StringVar(&c.ClusterDomain, "cluster-domain", "cluster.local", "cluster DNS domain")
	fs.StringVar(&c.Path, "path", "", "directories put before the host PATH in every container")
	fs.Var(listFlag{&workdirs}, "workdir", "IMAGE_PREFIX=DIR: working directory and HOME, owned by the container's user, for containers of such an image without workingDir (repeatable)")
	fs.Var(listFlag{&traversable}, "traversable", "DIR: made enterable (o+x) inside every container, for the environment's interpreter (repeatable)")
	fs.Var(listFlag{&entrypoints}, "entrypoint", "IMAGE_PREFIX=EXECUTABLE: what runs when a container of such an image has args but no command (repeatable)")
	fs.Var(listFlag{&envs}, "env", "KEY=VALUE added to every container's environment (repeatable)")
	fs.BoolVar(&c.Verbose, "v", false, "debug logging")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var errs []error
	need := func(v, name string) {
		if v == "" {
			errs = append(errs, fmt.Errorf("--%s is required", name))
		}
	}
	need(c.Kubeconfig, "kubeconfig")
	need(c.NodeName, "node-name")
	need(c.StateDir, "state-dir")
	need(c.TLSCert, "tls-cert")
	need(c.TLSKey, "tls-key")
	need(c.ClientCA, "client-ca")
	if c.StateDir != "" {
		abs, err := filepath.Abs(c.StateDir)
		if err != nil {
			errs = append(errs, err)
		}
		c.StateDir = filepath.Clean(abs)
		// overlayfs options are comma and colon separated: such paths cannot be passed.
		if strings.ContainsAny(c.StateDir, ",:\\ \t\n") || c.StateDir == "/" {
			errs = append(errs, fmt.Errorf("--state-dir %q: must not be / nor contain , : \\ or spaces (overlayfs options)", c.StateDir))
		}
	}
	var err error
	if cpus == "" {
		cpus = strconv.Itoa(numCPU())
	}
	if c.CPUs, err = resource.ParseQuantity(cpus); err != nil {
		errs = append(errs, fmt.Errorf("--cpus: %w", err))
	}
	if memory == "" {
		memory = strconv.FormatInt(hostMemory(), 10)
	}
	if c.Memory, err = resource.ParseQuantity(memory); err != nil {
		errs = append(errs, fmt.Errorf("--memory: %w", err))
	}
	if c.GPUs < 0 || c.Pods < 1 {
		errs = append(errs, errors.New("--gpus must be >= 0 and --pods >= 1"))
	}
	host, port, err := net.SplitHostPort(c.KubeletAddress)
	if err != nil {
		errs = append(errs, fmt.Errorf("--kubelet-address: %w", err))
	} else {
		p, perr := strconv.Atoi(port)
		if perr != nil || p <= 0 || p > 65535 {
			errs = append(errs, fmt.Errorf("--kubelet-address: bad port %q", port))
		}
		c.KubeletPort = int32(p)
		_ = host
	}
	dhost, dport, err := net.SplitHostPort(c.DNSAddress)
	if err != nil {
		errs = append(errs, fmt.Errorf("--dns-address: %w", err))
	} else {
		c.DNSIP = net.ParseIP(dhost)
		if c.DNSIP == nil || !c.DNSIP.IsLoopback() || c.DNSIP.To4() == nil {
			errs = append(errs, fmt.Errorf("--dns-address %q: must be an IPv4 loopback address", c.DNSAddress))
		}
		if dport != "53" {
			// resolv.conf cannot name a port: pods would not find the server.
			fmt.Fprintf(errOut, "warning: --dns-address port %s is not 53; pods' resolv.conf cannot point at it\n", dport)
		}
	}
	c.ClusterDomain = strings.Trim(strings.ToLower(c.ClusterDomain), ".")
	if c.ClusterDomain == "" {
		errs = append(errs, errors.New("--cluster-domain must not be empty"))
	}
	for _, e := range entrypoints {
		prefix, exe, ok := strings.Cut(e, "=")
		argv := strings.Fields(exe)
		if !ok || prefix == "" || len(argv) == 0 {
			errs = append(errs, fmt.Errorf("--entrypoint %q: want IMAGE_PREFIX=EXECUTABLE", e))
			continue
		}
		c.Entrypoints = append(c.Entrypoints, Entrypoint{Prefix: prefix, Argv: argv})
	}
	// Longest prefix first, so the first match is the most specific one.
	sort.SliceStable(c.Entrypoints, func(i, j int) bool {
		return len(c.Entrypoints[i].Prefix) > len(c.Entrypoints[j].Prefix)
	})
	for _, w := range workdirs {
		prefix, dir, ok := strings.Cut(w, "=")
		if !ok || prefix == "" || !filepath.IsAbs(dir) {
			errs = append(errs, fmt.Errorf("--workdir %q: want IMAGE_PREFIX=/ABSOLUTE/DIR", w))
			continue
		}
		c.Workdirs = append(c.Workdirs, Workdir{Prefix: prefix, Dir: filepath.Clean(dir)})
	}
	sort.SliceStable(c.Workdirs, func(i, j int) bool { return len(c.Workdirs[i].Prefix) > len(c.Workdirs[j].Prefix) })
	for _, d := range traversable {
		if !filepath.IsAbs(d) {
			errs = append(errs, fmt.Errorf("--traversable %q: want an absolute directory", d))
			continue
		}
		c.Traversable = append(c.Traversable, filepath.Clean(d))
	}
	for _, e := range envs {
		k, v, ok := strings.Cut(e, "=")
		if !ok || k == "" {
			errs = append(errs, fmt.Errorf("--env %q: want KEY=VALUE", e))
			continue
		}
		c.Env = append(c.Env, KV{k, v})
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return c, nil
}

// EntrypointFor returns the argv configured for image (longest matching prefix).
func (c *Config) EntrypointFor(image string) []string {
	for _, e := range c.Entrypoints {
		if strings.HasPrefix(image, e.Prefix) {
			return e.Argv
		}
	}
	return nil
}

// WorkdirFor returns the --workdir configured for image (longest matching prefix), or "".
func (c *Config) WorkdirFor(image string) string {
	for _, w := range c.Workdirs {
		if strings.HasPrefix(image, w.Prefix) {
			return w.Dir
		}
	}
	return ""
}

func numCPU() int { return goruntime.NumCPU() }

func hostMemory() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 1 << 30
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb * 1024
		}
	}
	return 1 << 30
}
