// Package status turns what the node knows about a pod's containers into a
// v1.PodStatus with the kubelet's phase and condition rules, so controllers
// (Jobs, ReplicaSets, the training operator, Flyte) read it as they would
// from a real kubelet.
package status

import (
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// HostIP is the only address of this node and of its pods.
const HostIP = "127.0.0.1"

// Container is the node's view of one container.
type Container struct {
	Name         string
	Image        string
	ImageID      string
	ContainerID  string
	State        v1.ContainerState
	LastState    v1.ContainerState
	Ready        bool
	Started      bool
	RestartCount int32
}

// Pod is the node's view of one pod.
type Pod struct {
	StartTime *metav1.Time
	// SandboxReady: volumes are materialised and containers may start.
	SandboxReady bool
	// InitDone: every (non-sidecar) init container has completed.
	InitDone bool
	Init     []Container
	App      []Container
	// Failed forces phase Failed with this reason and message (a volume that
	// cannot be provided, an init container that failed with restartPolicy
	// Never, the active deadline, a node restart).
	Failed        bool
	Reason        string
	Message       string
	Deleting      bool
	SandboxClosed bool
}

// Build computes the status of pod from the node's view p. The pod's current
// status provides what others own (conditions set by the scheduler or by
// readiness-gate controllers, the QoS class) and the previous transition times.
func Build(pod *v1.Pod, p *Pod, now time.Time) v1.PodStatus {
	st := *pod.Status.DeepCopy()
	st.HostIP = HostIP
	st.HostIPs = []v1.HostIP{{IP: HostIP}}
	st.PodIP = HostIP
	st.PodIPs = []v1.PodIP{{IP: HostIP}}
	st.StartTime = p.StartTime
	st.InitContainerStatuses = statuses(p.Init)
	st.ContainerStatuses = statuses(p.App)
	st.Phase = Phase(pod, p)
	st.Reason, st.Message = "", ""
	if p.Failed {
		st.Reason, st.Message = p.Reason, p.Message
	}
	setConditions(&st, pod, p, metav1.NewTime(now))
	return st
}

func statuses(cs []Container) []v1.ContainerStatus {
	if len(cs) == 0 {
		return nil
	}
	out := make([]v1.ContainerStatus, len(cs))
	for i, c := range cs {
		started := c.Started
		out[i] = v1.ContainerStatus{
			Name:                 c.Name,
			Image:                c.Image,
			ImageID:              c.ImageID,
			ContainerID:          c.ContainerID,
			State:                *c.State.DeepCopy(),
			LastTerminationState: *c.LastState.DeepCopy(),
			Ready:                c.Ready,
			Started:              &started,
			RestartCount:         c.RestartCount,
		}
	}
	return out
}

// Phase applies the kubelet's rules (pkg/kubelet getPhase) to the node's
// view. Like the kubelet's status manager, it reports a terminal phase only
// once nothing runs any more (a sidecar being stopped, a container inside its
// grace period): controllers must not see Succeeded while a process lives.
func Phase(pod *v1.Pod, p *Pod) v1.PodPhase {
	ph := phase(pod, p)
	if ph == v1.PodSucceeded || ph == v1.PodFailed {
		for _, cs := range [][]Container{p.Init, p.App} {
			for _, c := range cs {
				if c.State.Running != nil {
					return v1.PodRunning
				}
			}
		}
	}
	return ph
}

func phase(pod *v1.Pod, p *Pod) v1.PodPhase {
	if p.Failed {
		return v1.PodFailed
	}
	if !p.InitDone {
		return v1.PodPending
	}
	var waiting, running, stopped, succeeded int
	for _, c := range p.App {
		switch {
		case c.State.Running != nil:
			running++
		case c.State.Terminated != nil:
			stopped++
			if c.State.Terminated.ExitCode == 0 {
				succeeded++
			}
		case c.State.Waiting != nil:
			if c.LastState.Terminated != nil {
				// Restarting after a run: it counts as stopped.
				stopped++
				if c.LastState.Terminated.ExitCode == 0 {
					succeeded++
				}
			} else {
				waiting++
			}
		default:
			waiting++
		}
	}
	if p.Deleting && running == 0 && waiting == 0 && stopped > 0 {
		// Being deleted and everything has stopped: the pod is over.
		if stopped == succeeded {
			return v1.PodSucceeded
		}
		return v1.PodFailed
	}
	switch {
	case waiting > 0 && running == 0 && stopped == 0:
		return v1.PodPending
	case running > 0 || waiting > 0:
		return v1.PodRunning
	case stopped > 0:
		switch pod.Spec.RestartPolicy {
		case v1.RestartPolicyAlways:
			return v1.PodRunning
		case v1.RestartPolicyOnFailure:
			if stopped == succeeded {
				return v1.PodSucceeded
			}
			return v1.PodRunning
		default:
			if stopped == succeeded {
				return v1.PodSucceeded
			}
			return v1.PodFailed
		}
	}
	return v1.PodPending
}

// Our condition types; the others found in the pod are kept untouched.
var owned = map[v1.PodConditionType]bool{
	v1.PodReadyToStartContainers: true,
	v1.PodInitialized:            true,
	v1.ContainersReady:           true,
	v1.PodReady:                  true,
}

func setConditions(st *v1.PodStatus, pod *v1.Pod, p *Pod, now metav1.Time) {
	prev := map[v1.PodConditionType]v1.PodCondition{}
	var kept []v1.PodCondition
	for _, c := range pod.Status.Conditions {
		prev[c.Type] = c
		if !owned[c.Type] {
			kept = append(kept, c)
		}
	}
	if _, ok := prev[v1.PodScheduled]; !ok {
		kept = append(kept, v1.PodCondition{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: now})
	}
	mk := func(t v1.PodConditionType, ok bool, reason, msg string) v1.PodCondition {
		s := v1.ConditionFalse
		if ok {
			s = v1.ConditionTrue
			reason, msg = "", ""
		}
		c := v1.PodCondition{Type: t, Status: s, Reason: reason, Message: msg, LastTransitionTime: now}
		if old, found := prev[t]; found && old.Status == s {
			c.LastTransitionTime = old.LastTransitionTime
		}
		return c
	}
	done := st.Phase == v1.PodSucceeded || st.Phase == v1.PodFailed

	sandbox := p.SandboxReady && !p.SandboxClosed
	kept = append(kept, mk(v1.PodReadyToStartContainers, sandbox, "", ""))

	var notInit []string
	if !p.InitDone {
		for _, c := range p.Init {
			if c.State.Terminated == nil || c.State.Terminated.ExitCode != 0 {
				notInit = append(notInit, c.Name)
			}
		}
	}
	initOK := p.InitDone || len(notInit) == 0 && len(p.Init) == 0
	initReason := "ContainersNotInitialized"
	if done && st.Phase == v1.PodSucceeded {
		initOK, initReason = true, ""
	}
	kept = append(kept, mk(v1.PodInitialized, initOK, initReason, listMsg("containers with incomplete status", notInit)))

	var unready []string
	for _, c := range p.App {
		if !c.Ready {
			unready = append(unready, c.Name)
		}
	}
	// Restartable (sidecar) init containers must be ready too.
	for i, c := range p.Init {
		if i < len(pod.Spec.InitContainers) && isSidecar(&pod.Spec.InitContainers[i]) && !c.Ready {
			unready = append(unready, c.Name)
		}
	}
	reason := "ContainersNotReady"
	if done {
		reason = "PodCompleted"
	}
	ready := len(unready) == 0 && p.InitDone && !done
	kept = append(kept, mk(v1.ContainersReady, ready, reason, listMsg("containers with unready status", unready)))

	podReady := ready
	readyReason, readyMsg := reason, listMsg("containers with unready status", unready)
	if ready {
		// Readiness gates are conditions others set on the pod.
		var missing []string
		for _, g := range pod.Spec.ReadinessGates {
			if c, ok := prev[g.ConditionType]; !ok || c.Status != v1.ConditionTrue {
				missing = append(missing, string(g.ConditionType))
			}
		}
		if len(missing) > 0 {
			podReady = false
			readyReason, readyMsg = "ReadinessGatesNotReady", "corresponding condition of pod readiness gate \""+strings.Join(missing, "\", \"")+"\" does not exist or is not true."
		}
	}
	kept = append(kept, mk(v1.PodReady, podReady, readyReason, readyMsg))

	order := map[v1.PodConditionType]int{
		v1.PodScheduled: 0, v1.PodReadyToStartContainers: 1, v1.PodInitialized: 2, v1.ContainersReady: 3, v1.PodReady: 4,
	}
	sort.SliceStable(kept, func(i, j int) bool {
		oi, ok1 := order[kept[i].Type]
		oj, ok2 := order[kept[j].Type]
		if !ok1 {
			oi = 10
		}
		if !ok2 {
			oj = 10
		}
		return oi < oj
	})
	st.Conditions = kept
}

func listMsg(prefix string, names []string) string {
	if len(names) == 0 {
		return ""
	}
	return prefix + ": [" + strings.Join(names, " ") + "]"
}

func isSidecar(c *v1.Container) bool {
	return c.RestartPolicy != nil && *c.RestartPolicy == v1.ContainerRestartPolicyAlways
}

// Waiting is a convenience for a waiting state.
func Waiting(reason, msg string) v1.ContainerState {
	return v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: reason, Message: msg}}
}
