package env

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// Sources fetches the ConfigMaps and Secrets a pod refers to. A missing
// object must be reported with a Kubernetes NotFound error so that optional
// references can be told apart from failures.
type Sources interface {
	ConfigMap(namespace, name string) (*v1.ConfigMap, error)
	Secret(namespace, name string) (*v1.Secret, error)
}

// ConfigError is a container configuration that cannot be satisfied (yet): the
// kubelet shows it as the waiting reason CreateContainerConfigError and retries.
type ConfigError struct{ Msg string }

func (e *ConfigError) Error() string { return e.Msg }

// IsConfigError tells whether err is a ConfigError.
func IsConfigError(err error) bool {
	var ce *ConfigError
	return errors.As(err, &ce)
}

// Context is what a container's environment is computed from.
type Context struct {
	Pod         *v1.Pod
	Allocatable v1.ResourceList
	Sources     Sources
	// Base holds the node-given variables (PATH, HOME, HOSTNAME, --env, the
	// Kubernetes service variables); the container's own envFrom and env come
	// after them and override them.
	Base Vars
}

// Container returns the full environment of c.
func Container(c *v1.Container, ctx Context) (*Vars, error) {
	out := &Vars{}
	for _, n := range ctx.Base.names {
		out.Set(n, ctx.Base.values[n])
	}
	ns := ctx.Pod.Namespace
	for _, from := range c.EnvFrom {
		switch {
		case from.ConfigMapRef != nil:
			ref := from.ConfigMapRef
			cm, err := ctx.Sources.ConfigMap(ns, ref.Name)
			if err != nil {
				if apierrors.IsNotFound(err) && optional(ref.Optional) {
					continue
				}
				return nil, sourceErr("configmap", ns, ref.Name, err)
			}
			for _, k := range sortedKeys(cm.Data) {
				setFrom(out, from.Prefix+k, cm.Data[k])
			}
		case from.SecretRef != nil:
			ref := from.SecretRef
			s, err := ctx.Sources.Secret(ns, ref.Name)
			if err != nil {
				if apierrors.IsNotFound(err) && optional(ref.Optional) {
					continue
				}
				return nil, sourceErr("secret", ns, ref.Name, err)
			}
			keys := make([]string, 0, len(s.Data))
			for k := range s.Data {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				setFrom(out, from.Prefix+k, string(s.Data[k]))
			}
		}
	}
	// $(VAR) in env values sees only what is defined before it.
	for i := range c.Env {
		e := &c.Env[i]
		if e.ValueFrom == nil {
			out.Set(e.Name, Expand(e.Value, out.Get))
			continue
		}
		val, skip, err := valueFrom(e, c, ctx)
		if err != nil {
			return nil, err
		}
		if !skip {
			out.Set(e.Name, val)
		}
	}
	return out, nil
}

// setFrom adds an envFrom key; keys that cannot be environment variable names
// are skipped as the kubelet does.
func setFrom(out *Vars, name, value string) {
	if name == "" || strings.ContainsAny(name, "=\x00") {
		return
	}
	out.Set(name, value)
}

func valueFrom(e *v1.EnvVar, c *v1.Container, ctx Context) (string, bool, error) {
	vf := e.ValueFrom
	ns := ctx.Pod.Namespace
	switch {
	case vf.FieldRef != nil:
		v, err := FieldValue(ctx.Pod, vf.FieldRef.FieldPath)
		if err != nil {
			return "", false, &ConfigError{fmt.Sprintf("env %s: %v", e.Name, err)}
		}
		return v, false, nil
	case vf.ResourceFieldRef != nil:
		target := c
		if name := vf.ResourceFieldRef.ContainerName; name != "" && name != c.Name {
			target = findContainer(ctx.Pod, name)
			if target == nil {
				return "", false, &ConfigError{fmt.Sprintf("env %s: no container %q in the pod", e.Name, name)}
			}
		}
		v, err := ResourceValue(ctx.Pod, target, vf.ResourceFieldRef, ctx.Allocatable)
		if err != nil {
			return "", false, &ConfigError{fmt.Sprintf("env %s: %v", e.Name, err)}
		}
		return v, false, nil
	case vf.ConfigMapKeyRef != nil:
		ref := vf.ConfigMapKeyRef
		cm, err := ctx.Sources.ConfigMap(ns, ref.Name)
		if err != nil {
			if apierrors.IsNotFound(err) && optional(ref.Optional) {
				return "", true, nil
			}
			return "", false, sourceErr("configmap", ns, ref.Name, err)
		}
		if v, ok := cm.Data[ref.Key]; ok {
			return v, false, nil
		}
		if v, ok := cm.BinaryData[ref.Key]; ok {
			return string(v), false, nil
		}
		if optional(ref.Optional) {
			return "", true, nil
		}
		return "", false, &ConfigError{fmt.Sprintf("couldn't find key %s in ConfigMap %s/%s", ref.Key, ns, ref.Name)}
	case vf.SecretKeyRef != nil:
		ref := vf.SecretKeyRef
		s, err := ctx.Sources.Secret(ns, ref.Name)
		if err != nil {
			if apierrors.IsNotFound(err) && optional(ref.Optional) {
				return "", true, nil
			}
			return "", false, sourceErr("secret", ns, ref.Name, err)
		}
		if v, ok := s.Data[ref.Key]; ok {
			return string(v), false, nil
		}
		if optional(ref.Optional) {
			return "", true, nil
		}
		return "", false, &ConfigError{fmt.Sprintf("couldn't find key %s in Secret %s/%s", ref.Key, ns, ref.Name)}
	case vf.FileKeyRef != nil:
		return "", false, &ConfigError{fmt.Sprintf("env %s: fileKeyRef is not supported by this node", e.Name)}
	}
	return "", false, &ConfigError{fmt.Sprintf("env %s: empty valueFrom", e.Name)}
}

func sourceErr(kind, ns, name string, err error) error {
	if apierrors.IsNotFound(err) {
		return &ConfigError{fmt.Sprintf("%s %q not found", kind, name)}
	}
	return &ConfigError{fmt.Sprintf("%s %s/%s: %v", kind, ns, name, err)}
}

func optional(b *bool) bool { return b != nil && *b }

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func findContainer(pod *v1.Pod, name string) *v1.Container {
	for i := range pod.Spec.Containers {
		if pod.Spec.Containers[i].Name == name {
			return &pod.Spec.Containers[i]
		}
	}
	for i := range pod.Spec.InitContainers {
		if pod.Spec.InitContainers[i].Name == name {
			return &pod.Spec.InitContainers[i]
		}
	}
	return nil
}

// Argv computes what to execute for c with its final environment vars:
// command+args with $(VAR) expanded; with no command the image's entrypoint
// (from --entrypoint) runs with args, or else args[0] is the executable.
func Argv(c *v1.Container, vars *Vars, entrypoint []string) ([]string, error) {
	var argv []string
	for _, s := range c.Command {
		argv = append(argv, Expand(s, vars.Get))
	}
	if len(c.Command) == 0 && len(entrypoint) > 0 {
		argv = append(argv, entrypoint...)
	}
	for _, s := range c.Args {
		argv = append(argv, Expand(s, vars.Get))
	}
	if len(argv) == 0 || argv[0] == "" {
		return nil, &ConfigError{fmt.Sprintf("container %q has no command, and image %q has no --entrypoint on this node", c.Name, c.Image)}
	}
	return argv, nil
}

// ServiceLinks returns the docker-link style variables (FOO_SERVICE_HOST, ...)
// that the kubelet injects for Services when enableServiceLinks is on. Every
// Service is reached on 127.0.0.1 here since pods share the host's network.
func ServiceLinks(services []*v1.Service, out *Vars) {
	sorted := append([]*v1.Service(nil), services...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })
	for _, s := range sorted {
		if s.Spec.ClusterIP == "" || s.Spec.ClusterIP == v1.ClusterIPNone || len(s.Spec.Ports) == 0 {
			continue
		}
		name := strings.ToUpper(strings.ReplaceAll(s.Name, "-", "_"))
		host := PodIP
		out.Set(name+"_SERVICE_HOST", host)
		first := s.Spec.Ports[0]
		out.Set(name+"_SERVICE_PORT", strconv.Itoa(int(first.Port)))
		for _, p := range s.Spec.Ports {
			if p.Name != "" {
				out.Set(name+"_SERVICE_PORT_"+strings.ToUpper(strings.ReplaceAll(p.Name, "-", "_")), strconv.Itoa(int(p.Port)))
			}
		}
		proto := strings.ToLower(string(first.Protocol))
		if proto == "" {
			proto = "tcp"
		}
		out.Set(name+"_PORT", fmt.Sprintf("%s://%s:%d", proto, host, first.Port))
		for _, p := range s.Spec.Ports {
			pr := strings.ToLower(string(p.Protocol))
			if pr == "" {
				pr = "tcp"
			}
			prefix := fmt.Sprintf("%s_PORT_%d_%s", name, p.Port, strings.ToUpper(pr))
			out.Set(prefix, fmt.Sprintf("%s://%s:%d", pr, host, p.Port))
			out.Set(prefix+"_PROTO", pr)
			out.Set(prefix+"_PORT", strconv.Itoa(int(p.Port)))
			out.Set(prefix+"_ADDR", host)
		}
	}
}
