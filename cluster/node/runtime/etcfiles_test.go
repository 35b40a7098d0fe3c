package runtime

import (
	"reflect"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestHostsAndResolv(t *testing.T) {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "job-worker-0", Namespace: "team"},
		Spec: v1.PodSpec{Hostname: "w0", Subdomain: "job", HostAliases: []v1.HostAlias{{IP: "10.0.0.9", Hostnames: []string{"db", "db.local"}}}}}
	hosts := HostsFile(pod, "cluster.local", nil)
	for _, want := range []string{"127.0.0.1\tlocalhost\n", "127.0.0.1\tw0.job.team.svc.cluster.local\tw0\n", "10.0.0.9\tdb\tdb.local\n"} {
		if !strings.Contains(hosts, want) {
			t.Errorf("hosts lacks %q:\n%s", want, hosts)
		}
	}
	if Hostname(pod) != "w0" || FQDN(pod, "cluster.local") != "w0.job.team.svc.cluster.local" {
		t.Error("hostname/fqdn")
	}
	long := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: strings.Repeat("a", 62) + "-bcd"}}
	if h := Hostname(long); len(h) != 62 {
		t.Errorf("hostnames are cut to 63 chars without a trailing dash: %q", h)
	}

	hostResolv := []byte("# host\nnameserver 10.1.1.1\nnameserver 10.1.1.2\nsearch corp.example\noptions edns0\n")
	got := ResolvConf(pod, "127.0.0.10", "cluster.local", hostResolv)
	want := "nameserver 127.0.0.10\nsearch team.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
	if got != want {
		t.Errorf("ClusterFirst:\n%s\nwant\n%s", got, want)
	}
	def := pod.DeepCopy()
	def.Spec.DNSPolicy = v1.DNSDefault
	if got := ResolvConf(def, "127.0.0.10", "cluster.local", hostResolv); got != "nameserver 10.1.1.1\nnameserver 10.1.1.2\nsearch corp.example\noptions edns0\n" {
		t.Errorf("Default:\n%s", got)
	}
	hn := pod.DeepCopy()
	hn.Spec.HostNetwork = true
	if got := ResolvConf(hn, "127.0.0.10", "cluster.local", hostResolv); !strings.HasPrefix(got, "nameserver 10.1.1.1") {
		t.Errorf("ClusterFirst with hostNetwork falls back to the host's: %s", got)
	}
	none := pod.DeepCopy()
	two := "2"
	none.Spec.DNSPolicy = v1.DNSNone
	none.Spec.DNSConfig = &v1.PodDNSConfig{Nameservers: []string{"1.1.1.1"}, Searches: []string{"a.b"}, Options: []v1.PodDNSConfigOption{{Name: "ndots", Value: &two}}}
	if got := ResolvConf(none, "127.0.0.10", "cluster.local", hostResolv); got != "nameserver 1.1.1.1\nsearch a.b\noptions ndots:2\n" {
		t.Errorf("None:\n%s", got)
	}
	merged := pod.DeepCopy()
	merged.Spec.DNSConfig = &v1.PodDNSConfig{Options: []v1.PodDNSConfigOption{{Name: "ndots", Value: &two}, {Name: "edns0"}}}
	if got := ResolvConf(merged, "127.0.0.10", "cluster.local", nil); !strings.HasSuffix(got, "options ndots:2 edns0\n") {
		t.Errorf("dnsConfig options override: %s", got)
	}
	if FirstNameserver(hostResolv) != "10.1.1.1" {
		t.Error("FirstNameserver")
	}
}

func TestResolveIdentity(t *testing.T) {
	passwd := []byte("root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\n")
	group := []byte("root:x:0:\nalice:x:1000:\ndocker:x:998:alice,bob\n")
	i64 := func(v int64) *int64 { return &v }
	yes := true
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"}}
	c := &v1.Container{Name: "c"}

	id, err := ResolveIdentity(pod, c, passwd, group)
	if err != nil || id.UID != 0 || id.GID != 0 || id.Home != "/root" {
		t.Errorf("default: %+v %v", id, err)
	}
	pod.Spec.SecurityContext = &v1.PodSecurityContext{RunAsUser: i64(1000), FSGroup: i64(2000), SupplementalGroups: []int64{3000}}
	id, err = ResolveIdentity(pod, c, passwd, group)
	if err != nil || id.UID != 1000 || id.GID != 1000 || id.Home != "/home/alice" || !reflect.DeepEqual(id.Groups, []uint32{998, 2000, 3000}) {
		t.Errorf("runAsUser 1000: %+v %v", id, err)
	}
	c.SecurityContext = &v1.SecurityContext{RunAsUser: i64(4242), RunAsGroup: i64(77)}
	id, _ = ResolveIdentity(pod, c, passwd, group)
	if id.UID != 4242 || id.GID != 77 || id.Home != "/" {
		t.Errorf("unknown uid: %+v", id)
	}
	nonRoot := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"}, Spec: v1.PodSpec{SecurityContext: &v1.PodSecurityContext{RunAsNonRoot: &yes}}}
	if _, err := ResolveIdentity(nonRoot, &v1.Container{Name: "c"}, passwd, group); err == nil || !strings.Contains(err.Error(), "runAsNonRoot and image will run as root") {
		t.Errorf("runAsNonRoot as root: %v", err)
	}
	if _, err := ResolveIdentity(nonRoot, &v1.Container{Name: "c", SecurityContext: &v1.SecurityContext{RunAsUser: i64(1000)}}, passwd, group); err != nil {
		t.Errorf("runAsNonRoot with uid 1000: %v", err)
	}
}

func TestMountinfoHelpers(t *testing.T) {
	if got := unescapeOctal(`/mnt/with\040space`); got != "/mnt/with space" {
		t.Errorf("unescape: %q", got)
	}
	if !under("/a/b", "/a") || under("/ab", "/a") || !coveredBy("/proc/sys", []string{"/proc"}) {
		t.Error("path helpers")
	}
}
