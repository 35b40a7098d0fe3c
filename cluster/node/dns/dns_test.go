package dns

import (
	"net"
	"strings"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

type fakeLookup struct {
	services map[string]*v1.Service
	pods     []*v1.Pod
}

func (f fakeLookup) Service(ns, name string) (*v1.Service, bool) {
	s, ok := f.services[ns+"/"+name]
	return s, ok
}

func (f fakeLookup) PodsWithSubdomain(ns, sub string) []*v1.Pod {
	var out []*v1.Pod
	for _, p := range f.pods {
		if p.Namespace == ns && p.Spec.Subdomain == sub {
			out = append(out, p)
		}
	}
	return out
}

func lookup() fakeLookup {
	return fakeLookup{
		services: map[string]*v1.Service{
			"team/myjob-master-0": {Spec: v1.ServiceSpec{ClusterIP: "10.96.1.1"}},
			"team/headless":       {Spec: v1.ServiceSpec{ClusterIP: v1.ClusterIPNone}},
			"team/ext":            {Spec: v1.ServiceSpec{Type: v1.ServiceTypeExternalName, ExternalName: "db.team.svc.cluster.local"}},
			"team/db":             {Spec: v1.ServiceSpec{ClusterIP: "10.96.1.2"}},
		},
		pods: []*v1.Pod{
			{ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: "team"}, Spec: v1.PodSpec{Subdomain: "headless"}},
			{ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: "team"}, Spec: v1.PodSpec{Hostname: "worker", Subdomain: "headless"}},
		},
	}
}

// startServer runs the server on a free loopback port.
func startServer(t *testing.T, upstream string) (*Server, string) {
	t.Helper()
	l, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.LocalAddr().String()
	l.Close()
	s := &Server{Domain: "cluster.local", Lookup: lookup(), Upstream: upstream, Timeout: time.Second}
	if err := s.ListenAndServe(addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	return s, addr
}

func ask(t *testing.T, addr, name string, qtype uint16, netw string) *mdns.Msg {
	t.Helper()
	m := new(mdns.Msg)
	m.SetQuestion(name, qtype)
	c := &mdns.Client{Net: netw, Timeout: 2 * time.Second}
	var r *mdns.Msg
	var err error
	for i := 0; i < 20; i++ { // the listener goroutines may need a moment
		if r, _, err = c.Exchange(m, addr); err == nil {
			return r
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("query %s: %v", name, err)
	return nil
}

func aRecords(m *mdns.Msg) []string {
	var out []string
	for _, rr := range m.Answer {
		if a, ok := rr.(*mdns.A); ok {
			out = append(out, a.A.String())
		}
	}
	return out
}

func TestClusterNames(t *testing.T) {
	_, addr := startServer(t, "")
	for _, tc := range []struct {
		name  string
		qtype uint16
		rcode int
		a     string
	}{
		{"myjob-master-0.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "127.0.0.1"},
		{"MyJob-Master-0.Team.SVC.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "127.0.0.1"},
		{"headless.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "127.0.0.1"},
		{"web-0.headless.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "127.0.0.1"},
		{"worker.headless.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "127.0.0.1"},
		{"x.headless.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeNameError, ""},
		{"10-1-2-3.team.pod.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, "10.1.2.3"},
		{"myjob-master-0.team.svc.cluster.local.", mdns.TypeAAAA, mdns.RcodeSuccess, ""},
		{"nosuch.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeNameError, ""},
		{"myjob-master-0.other.svc.cluster.local.", mdns.TypeA, mdns.RcodeNameError, ""},
		{"google.com.team.svc.cluster.local.", mdns.TypeA, mdns.RcodeNameError, ""},
		{"team.svc.cluster.local.", mdns.TypeA, mdns.RcodeSuccess, ""},
		{"cluster.local.", mdns.TypeA, mdns.RcodeSuccess, ""},
	} {
		for _, netw := range []string{"udp", "tcp"} {
			r := ask(t, addr, tc.name, tc.qtype, netw)
			got := strings.Join(aRecords(r), ",")
			if r.Rcode != tc.rcode || got != tc.a {
				t.Errorf("%s %s (%s): rcode %s answers %q, want %s %q", tc.name, mdns.TypeToString[tc.qtype], netw,
					mdns.RcodeToString[r.Rcode], got, mdns.RcodeToString[tc.rcode], tc.a)
			}
			if !r.Authoritative {
				t.Errorf("%s: cluster answers are authoritative", tc.name)
			}
			if len(r.Answer) == 0 && len(r.Ns) == 0 {
				t.Errorf("%s: negative answers carry the SOA", tc.name)
			}
		}
	}
	// ExternalName: CNAME, chased to the in-cluster target.
	r := ask(t, addr, "ext.team.svc.cluster.local.", mdns.TypeA, "udp")
	if len(r.Answer) != 2 || r.Answer[0].Header().Rrtype != mdns.TypeCNAME || strings.Join(aRecords(r), ",") != "127.0.0.1" {
		t.Errorf("ExternalName: %v", r.Answer)
	}
}

func TestForwarding(t *testing.T) {
	// A fake upstream on loopback: no query leaves the machine.
	up, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	upstream := &mdns.Server{PacketConn: up, Handler: mdns.HandlerFunc(func(w mdns.ResponseWriter, req *mdns.Msg) {
		m := new(mdns.Msg)
		m.SetReply(req)
		if req.Question[0].Name == "example.org." {
			m.Answer = append(m.Answer, &mdns.A{Hdr: mdns.RR_Header{Name: "example.org.", Rrtype: mdns.TypeA, Class: mdns.ClassINET, Ttl: 60}, A: net.IPv4(192, 0, 2, 7)})
		} else {
			m.Rcode = mdns.RcodeNameError
		}
		_ = w.WriteMsg(m)
	})}
	go func() { _ = upstream.ActivateAndServe() }()
	defer upstream.Shutdown()
	_, addr := startServer(t, up.LocalAddr().String())
	r := ask(t, addr, "example.org.", mdns.TypeA, "udp")
	if got := strings.Join(aRecords(r), ","); got != "192.0.2.7" {
		t.Errorf("forwarded answer %q (rcode %s)", got, mdns.RcodeToString[r.Rcode])
	}
	if r := ask(t, addr, "nope.example.", mdns.TypeA, "udp"); r.Rcode != mdns.RcodeNameError {
		t.Errorf("forwarded NXDOMAIN: %s", mdns.RcodeToString[r.Rcode])
	}
	// No upstream: SERVFAIL, quickly.
	_, addr2 := startServer(t, "")
	if r := ask(t, addr2, "example.org.", mdns.TypeA, "udp"); r.Rcode != mdns.RcodeServerFailure {
		t.Errorf("without upstream: %s", mdns.RcodeToString[r.Rcode])
	}
}
