package env

import (
	"reflect"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestExpand(t *testing.T) {
	vars := map[string]string{"A": "1", "B": "two", "EMPTY": ""}
	lookup := func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
	for in, want := range map[string]string{
		"":                "",
		"plain":           "plain",
		"$(A)":            "1",
		"x$(A)y$(B)z":     "x1ytwoz",
		"$$(A)":           "$(A)",
		"$$$(A)":          "$1",
		"$(MISSING)":      "$(MISSING)",
		"$(EMPTY)-":       "-",
		"$A":              "$A",
		"$":               "$",
		"a$":              "a$",
		"$(A":             "$(A",
		"$()":             "$()",
		"$(A)$(A)":        "11",
		"100$$":           "100$",
		"$(A)$$$(B)$(":    "1$two$(",
		"echo $(B) && $x": "echo two && $x",
	} {
		if got := Expand(in, lookup); got != want {
			t.Errorf("Expand(%q) = %q, want %q", in, got, want)
		}
	}
}

type fakeSources struct {
	cms     map[string]*v1.ConfigMap
	secrets map[string]*v1.Secret
}

func notFound(kind, name string) error {
	return apierrors.NewNotFound(schema.GroupResource{Resource: kind}, name)
}

func (f fakeSources) ConfigMap(ns, name string) (*v1.ConfigMap, error) {
	if cm, ok := f.cms[name]; ok {
		return cm, nil
	}
	return nil, notFound("configmaps", name)
}

func (f fakeSources) Secret(ns, name string) (*v1.Secret, error) {
	if s, ok := f.secrets[name]; ok {
		return s, nil
	}
	return nil, notFound("secrets", name)
}

func testPod() *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "uid-1",
			Labels: map[string]string{"app": "x", "tier": "web"}, Annotations: map[string]string{"note": "a \"q\""}},
		Spec: v1.PodSpec{NodeName: "n1", ServiceAccountName: "sa"},
	}
}

func sources() fakeSources {
	return fakeSources{
		cms:     map[string]*v1.ConfigMap{"cm": {Data: map[string]string{"k": "v", "B": "b", "bad=name": "x"}, BinaryData: map[string][]byte{"bin": []byte("raw")}}},
		secrets: map[string]*v1.Secret{"s": {Data: map[string][]byte{"pw": []byte("hunter2"), "B": []byte("from-secret")}}},
	}
}

func yes() *bool { t := true; return &t }

func TestContainerEnv(t *testing.T) {
	pod := testPod()
	c := &v1.Container{
		Name: "c",
		Resources: v1.ResourceRequirements{
			Limits:   v1.ResourceList{v1.ResourceMemory: resource.MustParse("1Gi")},
			Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("250m")},
		},
		EnvFrom: []v1.EnvFromSource{
			{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "cm"}}},
			{Prefix: "S_", SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "s"}}},
			{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "gone"}, Optional: yes()}},
		},
		Env: []v1.EnvVar{
			{Name: "PATH", Value: "/override:$(PATH)"},
			{Name: "NAME", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
			{Name: "NS", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
			{Name: "UID", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.uid"}}},
			{Name: "APP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.labels['app']"}}},
			{Name: "NOTE", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.annotations['note']"}}},
			{Name: "NODE", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
			{Name: "SA", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.serviceAccountName"}}},
			{Name: "IP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
			{Name: "HOSTIP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "status.hostIP"}}},
			{Name: "MEM", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "limits.memory", Divisor: resource.MustParse("1Mi")}}},
			{Name: "CPU_REQ_M", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "requests.cpu", Divisor: resource.MustParse("1m")}}},
			{Name: "CPU_REQ", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "requests.cpu"}}},
			{Name: "CPU_LIM", ValueFrom: &v1.EnvVarSource{ResourceFieldRef: &v1.ResourceFieldSelector{Resource: "limits.cpu"}}},
			{Name: "K", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "cm"}, Key: "k"}}},
			{Name: "BIN", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "cm"}, Key: "bin"}}},
			{Name: "PW", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "s"}, Key: "pw"}}},
			{Name: "OPT", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "s"}, Key: "nope", Optional: yes()}}},
			{Name: "OPT2", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "gone"}, Key: "x", Optional: yes()}}},
			{Name: "COMBO", Value: "$(NAME).$(NS) $$(NAME) $(LATER)"},
			{Name: "LATER", Value: "late"},
			{Name: "B", Value: "env-wins"},
		},
	}
	var base Vars
	base.Set("PATH", "/venv/bin:/usr/bin")
	base.Set("HOSTNAME", "p")
	vars, err := Container(c, Context{Pod: pod, Sources: sources(), Base: base,
		Allocatable: v1.ResourceList{v1.ResourceCPU: resource.MustParse("8")}})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"PATH": "/override:/venv/bin:/usr/bin", "HOSTNAME": "p",
		"k": "v", "S_pw": "hunter2", "S_B": "from-secret",
		"NAME": "p", "NS": "ns", "UID": "uid-1", "APP": "x", "NOTE": `a "q"`, "NODE": "n1", "SA": "sa",
		"IP": "127.0.0.1", "HOSTIP": "127.0.0.1", "MEM": "1024", "CPU_REQ_M": "250", "CPU_REQ": "1", "CPU_LIM": "8",
		"K": "v", "BIN": "raw", "PW": "hunter2",
		"COMBO": "p.ns $(NAME) $(LATER)", "LATER": "late", "B": "env-wins",
	}
	for k, v := range want {
		if got, ok := vars.Get(k); !ok || got != v {
			t.Errorf("%s = %q (set %v), want %q", k, got, ok, v)
		}
	}
	for _, k := range []string{"OPT", "OPT2", "bad=name"} {
		if _, ok := vars.Get(k); ok {
			t.Errorf("%s should not be set", k)
		}
	}
	env := vars.Environ()
	if env[0] != "PATH=/override:/venv/bin:/usr/bin" || env[1] != "HOSTNAME=p" {
		t.Errorf("base variables should come first (overridden in place): %v", env[:2])
	}
}

func TestContainerEnvMissing(t *testing.T) {
	pod := testPod()
	for name, tc := range map[string]struct {
		env  []v1.EnvVar
		from []v1.EnvFromSource
		want string
	}{
		"missing configmap key": {env: []v1.EnvVar{{Name: "X", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "cm"}, Key: "absent"}}}},
			want: "couldn't find key absent in ConfigMap ns/cm"},
		"missing secret": {env: []v1.EnvVar{{Name: "X", ValueFrom: &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{LocalObjectReference: v1.LocalObjectReference{Name: "nosecret"}, Key: "k"}}}},
			want: `secret "nosecret" not found`},
		"missing envFrom configmap": {from: []v1.EnvFromSource{{ConfigMapRef: &v1.ConfigMapEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: "nocm"}}}},
			want: `configmap "nocm" not found`},
		"bad field": {env: []v1.EnvVar{{Name: "X", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.bogus"}}}},
			want: "spec.bogus"},
	} {
		_, err := Container(&v1.Container{Name: "c", Env: tc.env, EnvFrom: tc.from}, Context{Pod: pod, Sources: sources()})
		if err == nil || !IsConfigError(err) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want a ConfigError with %q", name, err, tc.want)
		}
	}
}

func TestArgv(t *testing.T) {
	var vars Vars
	vars.Set("X", "1")
	for name, tc := range map[string]struct {
		c    v1.Container
		ep   []string
		want []string
		err  bool
	}{
		"command and args":     {c: v1.Container{Command: []string{"sh", "-c"}, Args: []string{"echo $(X) $$(X)"}}, want: []string{"sh", "-c", "echo 1 $(X)"}},
		"command only":         {c: v1.Container{Command: []string{"/bin/true"}}, ep: []string{"ignored"}, want: []string{"/bin/true"}},
		"args with entrypoint": {c: v1.Container{Args: []string{"--x=$(X)"}}, ep: []string{"python", "-m", "app"}, want: []string{"python", "-m", "app", "--x=1"}},
		"args as the command":  {c: v1.Container{Args: []string{"pyflyte-execute", "--a"}}, want: []string{"pyflyte-execute", "--a"}},
		"nothing to run":       {c: v1.Container{Name: "c", Image: "img"}, err: true},
	} {
		got, err := Argv(&tc.c, &vars, tc.ep)
		if tc.err {
			if err == nil || !IsConfigError(err) {
				t.Errorf("%s: want a config error, got %v", name, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: got %q %v, want %q", name, got, err, tc.want)
		}
	}
}

func TestServiceLinks(t *testing.T) {
	var out Vars
	ServiceLinks([]*v1.Service{
		{ObjectMeta: metav1.ObjectMeta{Name: "my-svc"}, Spec: v1.ServiceSpec{ClusterIP: "10.96.0.9", Ports: []v1.ServicePort{
			{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}, {Name: "dns-udp", Port: 53, Protocol: v1.ProtocolUDP}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "headless"}, Spec: v1.ServiceSpec{ClusterIP: v1.ClusterIPNone, Ports: []v1.ServicePort{{Port: 1}}}},
	}, &out)
	want := map[string]string{
		"MY_SVC_SERVICE_HOST": "127.0.0.1", "MY_SVC_SERVICE_PORT": "80", "MY_SVC_SERVICE_PORT_HTTP": "80",
		"MY_SVC_SERVICE_PORT_DNS_UDP": "53", "MY_SVC_PORT": "tcp://127.0.0.1:80",
		"MY_SVC_PORT_80_TCP_ADDR": "127.0.0.1", "MY_SVC_PORT_53_UDP_PROTO": "udp",
	}
	for k, v := range want {
		if got, _ := out.Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}
	if _, ok := out.Get("HEADLESS_SERVICE_HOST"); ok {
		t.Error("headless services get no link variables")
	}
}

func TestFieldValueMaps(t *testing.T) {
	got, err := FieldValue(testPod(), "metadata.labels")
	if err != nil || got != "app=\"x\"\ntier=\"web\"" {
		t.Errorf("labels = %q, %v", got, err)
	}
	got, _ = FieldValue(testPod(), `metadata.annotations["note"]`)
	if got != `a "q"` {
		t.Errorf("annotation = %q", got)
	}
}
