package env

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// PodIP is the address every pod has: all pods share the host's network.
const PodIP = "127.0.0.1"

// FieldValue resolves a downward API fieldRef path against pod. Whole-map
// paths (metadata.labels, metadata.annotations) are only meaningful in
// downwardAPI volumes and are rendered as sorted key="value" lines.
func FieldValue(pod *v1.Pod, path string) (string, error) {
	if k, ok := subscript(path, "metadata.labels"); ok {
		return pod.Labels[k], nil
	}
	if k, ok := subscript(path, "metadata.annotations"); ok {
		return pod.Annotations[k], nil
	}
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "metadata.uid":
		return string(pod.UID), nil
	case "metadata.labels":
		return formatMap(pod.Labels), nil
	case "metadata.annotations":
		return formatMap(pod.Annotations), nil
	case "spec.nodeName":
		return pod.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, nil
	case "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs":
		return PodIP, nil
	}
	return "", fmt.Errorf("unsupported fieldRef fieldPath %q", path)
}

// subscript parses `prefix['key']` (the API server has validated the form).
func subscript(path, prefix string) (string, bool) {
	if !strings.HasPrefix(path, prefix+"[") || !strings.HasSuffix(path, "]") {
		return "", false
	}
	inner := path[len(prefix)+1 : len(path)-1]
	if len(inner) >= 2 && (inner[0] == '\'' || inner[0] == '"') && inner[len(inner)-1] == inner[0] {
		inner = inner[1 : len(inner)-1]
	}
	return inner, true
}

func formatMap(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(k + "=" + strconv.Quote(m[k]))
	}
	return b.String()
}

// ResourceValue resolves a resourceFieldRef for container c. Limits that are
// not set default to the node's allocatable amount, as the kubelet does; the
// result is rounded up to a whole number of divisors.
func ResourceValue(pod *v1.Pod, c *v1.Container, ref *v1.ResourceFieldSelector, allocatable v1.ResourceList) (string, error) {
	kind, name, ok := strings.Cut(ref.Resource, ".")
	if !ok || (kind != "limits" && kind != "requests") {
		// "cpu" style shorthands are not valid API values; be explicit.
		return "", fmt.Errorf("unsupported resourceFieldRef resource %q", ref.Resource)
	}
	rn := v1.ResourceName(name)
	var q resource.Quantity
	var found bool
	if kind == "limits" {
		q, found = c.Resources.Limits[rn]
		if !found {
			q, found = allocatable[rn]
		}
	} else {
		q, found = c.Resources.Requests[rn]
		if !found {
			q, found = c.Resources.Limits[rn]
		}
	}
	if !found {
		q = resource.Quantity{}
	}
	divisor := ref.Divisor
	if divisor.IsZero() {
		divisor = resource.MustParse("1")
	}
	if rn == v1.ResourceCPU {
		return strconv.FormatInt(int64(math.Ceil(float64(q.MilliValue())/float64(divisor.MilliValue()))), 10), nil
	}
	return strconv.FormatInt(int64(math.Ceil(float64(q.Value())/float64(divisor.Value()))), 10), nil
}
