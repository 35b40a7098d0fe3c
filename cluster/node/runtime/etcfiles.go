package runtime

import (
	"fmt"
	"os"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Hostname is the pod's hostname: spec.hostname, else the pod name (cut to
// the 63 characters a DNS label allows, as the kubelet does).
func Hostname(pod *v1.Pod) string {
	h := pod.Spec.Hostname
	if h == "" {
		h = pod.Name
	}
	if len(h) > 63 {
		h = strings.TrimRight(h[:63], "-.")
	}
	return h
}

// FQDN is hostname.subdomain.ns.svc.<domain> when the pod has a subdomain.
func FQDN(pod *v1.Pod, domain string) string {
	if pod.Spec.Subdomain == "" {
		return ""
	}
	return fmt.Sprintf("%s.%s.%s.svc.%s", Hostname(pod), pod.Spec.Subdomain, pod.Namespace, domain)
}

// HostsFile renders the pod's /etc/hosts. Host-network pods get the host's
// file plus their host aliases, as on a real node.
func HostsFile(pod *v1.Pod, domain string, hostHosts []byte) string {
	var b strings.Builder
	if pod.Spec.HostNetwork {
		b.Write(hostHosts)
		if len(hostHosts) > 0 && hostHosts[len(hostHosts)-1] != '\n' {
			b.WriteByte('\n')
		}
	} else {
		b.WriteString("# Kubernetes-managed hosts file (fuseforge host-process node).\n")
		b.WriteString("127.0.0.1\tlocalhost\n")
		b.WriteString("::1\tlocalhost ip6-localhost ip6-loopback\n")
		b.WriteString("fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n")
		if fq := FQDN(pod, domain); fq != "" {
			fmt.Fprintf(&b, "127.0.0.1\t%s\t%s\n", fq, Hostname(pod))
		} else {
			fmt.Fprintf(&b, "127.0.0.1\t%s\n", Hostname(pod))
		}
	}
	if len(pod.Spec.HostAliases) > 0 {
		b.WriteString("\n# Entries added by HostAliases.\n")
		for _, a := range pod.Spec.HostAliases {
			fmt.Fprintf(&b, "%s\t%s\n", a.IP, strings.Join(a.Hostnames, "\t"))
		}
	}
	return b.String()
}

// ResolvConf renders the pod's /etc/resolv.conf for its dnsPolicy: the
// cluster DNS with the Kubernetes search path, or the host's file.
func ResolvConf(pod *v1.Pod, dnsIP, domain string, hostResolv []byte) string {
	policy := pod.Spec.DNSPolicy
	if policy == "" {
		policy = v1.DNSClusterFirst
	}
	if policy == v1.DNSClusterFirst && pod.Spec.HostNetwork {
		policy = v1.DNSDefault
	}
	var servers, searches, options []string
	switch policy {
	case v1.DNSClusterFirst, v1.DNSClusterFirstWithHostNet:
		servers = []string{dnsIP}
		searches = []string{pod.Namespace + ".svc." + domain, "svc." + domain, domain}
		options = []string{"ndots:5"}
	case v1.DNSDefault:
		servers, searches, options = parseResolv(hostResolv)
	case v1.DNSNone:
	}
	if c := pod.Spec.DNSConfig; c != nil {
		servers = appendNew(servers, c.Nameservers...)
		searches = appendNew(searches, c.Searches...)
		for _, o := range c.Options {
			opt := o.Name
			if o.Value != nil {
				opt += ":" + *o.Value
			}
			options = mergeOption(options, opt)
		}
	}
	var b strings.Builder
	for _, s := range servers {
		fmt.Fprintf(&b, "nameserver %s\n", s)
	}
	if len(searches) > 0 {
		fmt.Fprintf(&b, "search %s\n", strings.Join(searches, " "))
	}
	if len(options) > 0 {
		fmt.Fprintf(&b, "options %s\n", strings.Join(options, " "))
	}
	return b.String()
}

func parseResolv(b []byte) (servers, searches, options []string) {
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") || strings.HasPrefix(f[0], ";") {
			continue
		}
		switch f[0] {
		case "nameserver":
			servers = append(servers, f[1])
		case "search", "domain":
			searches = f[1:]
		case "options":
			options = append(options, f[1:]...)
		}
	}
	return
}

func appendNew(list []string, more ...string) []string {
	for _, m := range more {
		found := false
		for _, l := range list {
			if l == m {
				found = true
			}
		}
		if !found {
			list = append(list, m)
		}
	}
	return list
}

func mergeOption(opts []string, opt string) []string {
	name, _, _ := strings.Cut(opt, ":")
	for i, o := range opts {
		if n, _, _ := strings.Cut(o, ":"); n == name {
			opts[i] = opt
			return opts
		}
	}
	return append(opts, opt)
}

// HostFile reads a host file, empty if missing.
func HostFile(path string) []byte {
	b, _ := os.ReadFile(path)
	return b
}

// FirstNameserver is the host's first resolver, where cluster DNS forwards.
func FirstNameserver(hostResolv []byte) string {
	s, _, _ := parseResolv(hostResolv)
	if len(s) == 0 {
		return ""
	}
	return s[0]
}
