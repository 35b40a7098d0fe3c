// Package env builds a container's environment and argv the way the kubelet
// does: valueFrom/envFrom resolution and $(VAR) expansion.
package env

import "strings"

// Expand replaces $(VAR) references in s following Kubernetes' rules: a
// reference to a variable that lookup knows is replaced by its value, an
// unknown one is left as written, "$$" is an escaped "$", and any other "$" is
// kept as it is.
func Expand(s string, lookup func(string) (string, bool)) string {
	if !strings.Contains(s, "$") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch next := s[i+1]; next {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				// Unterminated reference: kept literally.
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := lookup(name); ok && name != "" {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// Vars is an ordered environment: later Set calls override earlier values
// while keeping the variable at its first position.
type Vars struct {
	names  []string
	values map[string]string
}

// Set defines or overrides a variable.
func (v *Vars) Set(name, value string) {
	if v.values == nil {
		v.values = map[string]string{}
	}
	if _, ok := v.values[name]; !ok {
		v.names = append(v.names, name)
	}
	v.values[name] = value
}

// Get returns a variable's value.
func (v *Vars) Get(name string) (string, bool) {
	val, ok := v.values[name]
	return val, ok
}

// Environ returns NAME=VALUE strings in definition order.
func (v *Vars) Environ() []string {
	out := make([]string, 0, len(v.names))
	for _, n := range v.names {
		out = append(out, n+"="+v.values[n])
	}
	return out
}

// Len is the number of variables.
func (v *Vars) Len() int { return len(v.names) }
