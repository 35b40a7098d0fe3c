// Package gpu hands out GPU indices to pods so that each container that asks
// for nvidia.com/gpu sees only its own devices (NVIDIA_VISIBLE_DEVICES and
// CUDA_VISIBLE_DEVICES), as the NVIDIA device plugin would arrange.
package gpu

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
)

// Resource is the extended resource name the node advertises.
const Resource v1.ResourceName = "nvidia.com/gpu"

// Allocator tracks which of the node's GPUs belong to which pod.
type Allocator struct {
	mu    sync.Mutex
	total int
	owner map[int]string
}

// New makes an allocator over n GPUs (indices 0..n-1).
func New(n int) *Allocator { return &Allocator{total: n, owner: map[int]string{}} }

// Count is how many GPUs container c asks for (limits, else requests).
func Count(c *v1.Container) int {
	if q, ok := c.Resources.Limits[Resource]; ok {
		return int(q.Value())
	}
	if q, ok := c.Resources.Requests[Resource]; ok {
		return int(q.Value())
	}
	return 0
}

// Assignment maps container names to their GPU indices.
type Assignment map[string][]int

// Allocate reserves GPUs for pod key: app containers get disjoint sets; init
// containers run before them and reuse the first indices of the pod's set.
func (a *Allocator) Allocate(key string, pod *v1.Pod) (Assignment, error) {
	need := 0
	for i := range pod.Spec.Containers {
		need += Count(&pod.Spec.Containers[i])
	}
	for i := range pod.Spec.InitContainers {
		if n := Count(&pod.Spec.InitContainers[i]); n > need {
			need = n
		}
	}
	out := Assignment{}
	if need == 0 {
		return out, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var mine []int
	for i := 0; i < a.total && len(mine) < need; i++ {
		if o, taken := a.owner[i]; !taken || o == key {
			mine = append(mine, i)
		}
	}
	if len(mine) < need {
		return nil, fmt.Errorf("pod needs %d nvidia.com/gpu but only %d of %d are free on this node", need, len(mine), a.total)
	}
	for _, i := range mine {
		a.owner[i] = key
	}
	next := 0
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		n := Count(c)
		out[c.Name] = append([]int(nil), mine[next:next+n]...)
		next += n
	}
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		out[c.Name] = append([]int(nil), mine[:Count(c)]...)
	}
	return out, nil
}

// Release frees the pod's GPUs.
func (a *Allocator) Release(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, o := range a.owner {
		if o == key {
			delete(a.owner, i)
		}
	}
}

// Visible renders indices as the value of *_VISIBLE_DEVICES.
func Visible(idx []int) string {
	s := append([]int(nil), idx...)
	sort.Ints(s)
	parts := make([]string, len(s))
	for i, v := range s {
		parts[i] = strconv.Itoa(v)
	}
	if len(parts) == 0 {
		// "void" hides every device from the NVIDIA container stack; CUDA
		// treats an empty list as none.
		return ""
	}
	return strings.Join(parts, ",")
}
