// Package dns is the cluster DNS of this one-machine cluster. Every Service
// (ClusterIP or headless) and every pod hostname under a subdomain answers
// 127.0.0.1, because all pods share the host's network: that is what makes
// `nslookup <svc>` and getaddrinfo("<job>-master-0") work in pods. Names
// outside the cluster domain go to the host's resolver.
package dns

import (
	"context"
	"net"
	"strings"
	"time"

	mdns "github.com/miekg/dns"
	v1 "k8s.io/api/core/v1"
)

// Lookup is the cluster state the server answers from (informer caches).
type Lookup interface {
	Service(namespace, name string) (*v1.Service, bool)
	PodsWithSubdomain(namespace, subdomain string) []*v1.Pod
}

// Server answers A/AAAA for the cluster domain and forwards the rest.
type Server struct {
	Domain string // e.g. "cluster.local" (no dots at the ends)
	Lookup Lookup
	// Upstream is host:port of the resolver for other names ("" = SERVFAIL).
	Upstream string
	// Timeout for upstream queries.
	Timeout time.Duration
	// Answer is the address every cluster name resolves to.
	Answer net.IP

	udp, tcp *mdns.Server
}

const ttl = 5

// ListenAndServe starts UDP and TCP servers on addr and returns once both listen.
func (s *Server) ListenAndServe(addr string) error {
	if s.Timeout == 0 {
		s.Timeout = 2 * time.Second
	}
	if s.Answer == nil {
		s.Answer = net.IPv4(127, 0, 0, 1)
	}
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		pc.Close()
		return err
	}
	s.udp = &mdns.Server{PacketConn: pc, Handler: s}
	s.tcp = &mdns.Server{Listener: l, Handler: s}
	go func() { _ = s.udp.ActivateAndServe() }()
	go func() { _ = s.tcp.ActivateAndServe() }()
	return nil
}

// Shutdown stops both servers.
func (s *Server) Shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if s.udp != nil {
		_ = s.udp.ShutdownContext(ctx)
	}
	if s.tcp != nil {
		_ = s.tcp.ShutdownContext(ctx)
	}
}

// ServeDNS implements mdns.Handler.
func (s *Server) ServeDNS(w mdns.ResponseWriter, req *mdns.Msg) {
	if len(req.Question) != 1 {
		m := new(mdns.Msg)
		m.SetRcode(req, mdns.RcodeFormatError)
		_ = w.WriteMsg(m)
		return
	}
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	suffix := "." + s.Domain + "."
	if name != s.Domain+"." && !strings.HasSuffix(name, suffix) {
		_ = w.WriteMsg(s.forward(w, req))
		return
	}
	m := s.Answer4(req)
	// Chase an ExternalName's CNAME once, as a recursive server would: stub
	// resolvers expect the address in the same answer.
	if len(m.Answer) == 1 && (q.Qtype == mdns.TypeA || q.Qtype == mdns.TypeAAAA) {
		if c, ok := m.Answer[0].(*mdns.CNAME); ok {
			sub := new(mdns.Msg)
			sub.SetQuestion(c.Target, q.Qtype)
			var r *mdns.Msg
			if strings.HasSuffix(strings.ToLower(c.Target), suffix) {
				r = s.Answer4(sub)
			} else {
				r = s.forward(w, sub)
			}
			if r != nil && r.Rcode == mdns.RcodeSuccess {
				m.Answer = append(m.Answer, r.Answer...)
			}
		}
	}
	_ = w.WriteMsg(m)
}

// Answer4 builds the reply for a question inside the cluster domain.
func (s *Server) Answer4(req *mdns.Msg) *mdns.Msg {
	q := req.Question[0]
	m := new(mdns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	m.RecursionAvailable = true
	name := strings.ToLower(q.Name)
	rel := strings.TrimSuffix(strings.TrimSuffix(name, s.Domain+"."), ".")
	var labels []string
	if rel != "" {
		labels = strings.Split(rel, ".")
	}
	exists, ip, cname := s.resolve(labels)
	if !exists {
		m.Rcode = mdns.RcodeNameError
		m.Ns = []mdns.RR{s.soa()}
		return m
	}
	switch {
	case cname != "":
		m.Answer = append(m.Answer, &mdns.CNAME{Hdr: hdr(q.Name, mdns.TypeCNAME), Target: mdns.Fqdn(cname)})
	case ip != nil && (q.Qtype == mdns.TypeA || q.Qtype == mdns.TypeANY):
		m.Answer = append(m.Answer, &mdns.A{Hdr: hdr(q.Name, mdns.TypeA), A: ip})
	default:
		// NODATA: the name exists but has no record of this type (AAAA included).
		m.Ns = []mdns.RR{s.soa()}
	}
	return m
}

func hdr(name string, t uint16) mdns.RR_Header {
	return mdns.RR_Header{Name: name, Rrtype: t, Class: mdns.ClassINET, Ttl: ttl}
}

func (s *Server) soa() mdns.RR {
	return &mdns.SOA{
		Hdr:     hdr(s.Domain+".", mdns.TypeSOA),
		Ns:      "ns.dns." + s.Domain + ".",
		Mbox:    "hostmaster." + s.Domain + ".",
		Serial:  1,
		Refresh: 7200, Retry: 1800, Expire: 86400, Minttl: ttl,
	}
}

// resolve interprets the labels before the cluster domain. It reports whether
// the name exists, its address, or a CNAME target (ExternalName Services).
func (s *Server) resolve(labels []string) (bool, net.IP, string) {
	n := len(labels)
	switch {
	case n == 0:
		return true, nil, "" // the domain itself
	case labels[n-1] == "svc":
		switch n {
		case 1, 2: // svc.<domain>, <ns>.svc.<domain>
			return true, nil, ""
		case 3: // <svc>.<ns>.svc
			svc, ok := s.Lookup.Service(labels[1], labels[0])
			if !ok {
				return false, nil, ""
			}
			if svc.Spec.Type == v1.ServiceTypeExternalName && svc.Spec.ExternalName != "" {
				return true, nil, svc.Spec.ExternalName
			}
			return true, s.Answer, ""
		case 4: // <hostname>.<subdomain>.<ns>.svc
			for _, p := range s.Lookup.PodsWithSubdomain(labels[2], labels[1]) {
				h := p.Spec.Hostname
				if h == "" {
					h = p.Name
				}
				if strings.EqualFold(h, labels[0]) {
					return true, s.Answer, ""
				}
			}
			// _port._proto.<svc>.<ns>.svc (SRV) is not served.
			return false, nil, ""
		}
	case labels[n-1] == "pod":
		switch n {
		case 1, 2:
			return true, nil, ""
		case 3: // a-b-c-d.<ns>.pod
			ip := net.ParseIP(strings.ReplaceAll(labels[0], "-", "."))
			if ip4 := ip.To4(); ip4 != nil {
				return true, ip4, ""
			}
		}
	}
	return false, nil, ""
}

// forward relays a query to the host's resolver (UDP, then TCP if truncated).
func (s *Server) forward(w mdns.ResponseWriter, req *mdns.Msg) *mdns.Msg {
	fail := func() *mdns.Msg {
		m := new(mdns.Msg)
		m.SetRcode(req, mdns.RcodeServerFailure)
		m.RecursionAvailable = true
		return m
	}
	if s.Upstream == "" {
		return fail()
	}
	netw := "udp"
	if _, ok := w.RemoteAddr().(*net.TCPAddr); ok {
		netw = "tcp"
	}
	c := &mdns.Client{Net: netw, Timeout: s.Timeout}
	resp, _, err := c.Exchange(req, s.Upstream)
	if err == nil && resp.Truncated && netw == "udp" {
		c.Net = "tcp"
		resp, _, err = c.Exchange(req, s.Upstream)
	}
	if err != nil || resp == nil {
		return fail()
	}
	resp.Id = req.Id
	if netw == "udp" {
		size := mdns.MinMsgSize
		if o := req.IsEdns0(); o != nil {
			size = int(o.UDPSize())
		}
		resp.Truncate(size)
	}
	return resp
}
