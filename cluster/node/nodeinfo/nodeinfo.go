// Package nodeinfo describes this machine as a Kubernetes Node: the capacity
// the scheduler checks pods' requests against, the kubelet endpoint the API
// server calls for logs, and only labels NodeRestriction lets a node set.
package nodeinfo

import (
	"os"
	goruntime "runtime"
	"strings"

	"fuseforge.dev/cluster/node/config"
	"fuseforge.dev/cluster/node/gpu"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Resources is what the node advertises (capacity = allocatable).
func Resources(c *config.Config) v1.ResourceList {
	rl := v1.ResourceList{
		v1.ResourceCPU:    c.CPUs,
		v1.ResourceMemory: c.Memory,
		v1.ResourcePods:   *resource.NewQuantity(int64(c.Pods), resource.DecimalSI),
		gpu.Resource:      *resource.NewQuantity(int64(c.GPUs), resource.DecimalSI),
	}
	var st unix.Statfs_t
	if err := unix.Statfs(c.StateDir, &st); err == nil {
		rl[v1.ResourceEphemeralStorage] = *resource.NewQuantity(int64(st.Blocks)*st.Bsize, resource.BinarySI)
	}
	return rl
}

// Build returns the Node object to register. kubeletVersion is reported as is.
func Build(c *config.Config, kubeletVersion string) v1.Node {
	res := Resources(c)
	now := metav1.Now()
	cond := func(t v1.NodeConditionType, s v1.ConditionStatus, reason, msg string) v1.NodeCondition {
		return v1.NodeCondition{Type: t, Status: s, Reason: reason, Message: msg, LastHeartbeatTime: now, LastTransitionTime: now}
	}
	return v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: c.NodeName,
			Labels: map[string]string{
				"kubernetes.io/hostname": c.NodeName,
				"kubernetes.io/os":       goruntime.GOOS,
				"kubernetes.io/arch":     goruntime.GOARCH,
				"type":                   "host-process",
			},
		},
		Status: v1.NodeStatus{
			Phase:       v1.NodePending,
			Capacity:    res,
			Allocatable: res.DeepCopy(),
			Addresses:   []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}},
			DaemonEndpoints: v1.NodeDaemonEndpoints{
				KubeletEndpoint: v1.DaemonEndpoint{Port: c.KubeletPort},
			},
			Conditions: []v1.NodeCondition{
				cond(v1.NodeReady, v1.ConditionFalse, "KubeletNotReady", "starting"),
				cond(v1.NodeMemoryPressure, v1.ConditionFalse, "KubeletHasSufficientMemory", "memory is not tracked by this node"),
				cond(v1.NodeDiskPressure, v1.ConditionFalse, "KubeletHasNoDiskPressure", "disk is not tracked by this node"),
				cond(v1.NodePIDPressure, v1.ConditionFalse, "KubeletHasSufficientPID", "pids are not tracked by this node"),
			},
			NodeInfo: v1.NodeSystemInfo{
				MachineID:               readTrim("/etc/machine-id"),
				BootID:                  readTrim("/proc/sys/kernel/random/boot_id"),
				KernelVersion:           kernel(),
				OSImage:                 osImage(),
				ContainerRuntimeVersion: "host-process://1",
				KubeletVersion:          kubeletVersion,
				OperatingSystem:         goruntime.GOOS,
				Architecture:            goruntime.GOARCH,
			},
		},
	}
}

func readTrim(p string) string {
	b, _ := os.ReadFile(p)
	return strings.TrimSpace(string(b))
}

func kernel() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

func osImage() string {
	for _, line := range strings.Split(readTrim("/etc/os-release"), "\n") {
		if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
			return strings.Trim(v, `"`)
		}
	}
	return "Linux"
}
