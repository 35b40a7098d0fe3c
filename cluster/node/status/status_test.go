package status

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func running() v1.ContainerState {
	return v1.ContainerState{Running: &v1.ContainerStateRunning{}}
}

func exited(code int32) v1.ContainerState {
	return v1.ContainerState{Terminated: &v1.ContainerStateTerminated{ExitCode: code}}
}

func pod(policy v1.RestartPolicy) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"},
		Spec: v1.PodSpec{RestartPolicy: policy, InitContainers: []v1.Container{{Name: "i"}},
			Containers: []v1.Container{{Name: "a"}, {Name: "b"}}},
		Status: v1.PodStatus{QOSClass: v1.PodQOSBestEffort, Conditions: []v1.PodCondition{
			{Type: v1.PodScheduled, Status: v1.ConditionTrue},
			{Type: "example.com/gate", Status: v1.ConditionTrue},
		}},
	}
}

func TestPhase(t *testing.T) {
	waitingRestart := Container{State: Waiting("CrashLoopBackOff", ""), LastState: exited(1)}
	for name, tc := range map[string]struct {
		policy v1.RestartPolicy
		view   Pod
		want   v1.PodPhase
	}{
		"init running":                  {v1.RestartPolicyAlways, Pod{Init: []Container{{State: running()}}}, v1.PodPending},
		"containers creating":           {v1.RestartPolicyAlways, Pod{InitDone: true, App: []Container{{State: Waiting("ContainerCreating", "")}, {State: Waiting("ContainerCreating", "")}}}, v1.PodPending},
		"one running":                   {v1.RestartPolicyNever, Pod{InitDone: true, App: []Container{{State: running()}, {State: Waiting("ContainerCreating", "")}}}, v1.PodRunning},
		"never: all succeeded":          {v1.RestartPolicyNever, Pod{InitDone: true, App: []Container{{State: exited(0)}, {State: exited(0)}}}, v1.PodSucceeded},
		"never: one failed":             {v1.RestartPolicyNever, Pod{InitDone: true, App: []Container{{State: exited(0)}, {State: exited(3)}}}, v1.PodFailed},
		"never: one still running":      {v1.RestartPolicyNever, Pod{InitDone: true, App: []Container{{State: running()}, {State: exited(3)}}}, v1.PodRunning},
		"onfailure: failed restarts":    {v1.RestartPolicyOnFailure, Pod{InitDone: true, App: []Container{{State: exited(0)}, waitingRestart}}, v1.PodRunning},
		"onfailure: all succeeded":      {v1.RestartPolicyOnFailure, Pod{InitDone: true, App: []Container{{State: exited(0)}, {State: exited(0)}}}, v1.PodSucceeded},
		"always: exited is restarted":   {v1.RestartPolicyAlways, Pod{InitDone: true, App: []Container{{State: exited(0)}, {State: exited(0)}}}, v1.PodRunning},
		"forced failure, still running": {v1.RestartPolicyAlways, Pod{InitDone: true, Failed: true, App: []Container{{State: running()}}}, v1.PodRunning},
		"forced failure":                {v1.RestartPolicyAlways, Pod{InitDone: true, Failed: true, App: []Container{{State: exited(137)}}}, v1.PodFailed},
		"sidecar still running":         {v1.RestartPolicyNever, Pod{InitDone: true, Init: []Container{{State: running()}}, App: []Container{{State: exited(0)}, {State: exited(0)}}}, v1.PodRunning},
		"deleted, exited 0":             {v1.RestartPolicyAlways, Pod{InitDone: true, Deleting: true, App: []Container{{State: exited(0)}, {State: exited(0)}}}, v1.PodSucceeded},
		"deleted, killed":               {v1.RestartPolicyAlways, Pod{InitDone: true, Deleting: true, App: []Container{{State: exited(143)}, {State: exited(0)}}}, v1.PodFailed},
	} {
		if got := Phase(pod(tc.policy), &tc.view); got != tc.want {
			t.Errorf("%s: phase %s, want %s", name, got, tc.want)
		}
	}
}

func cond(st v1.PodStatus, t v1.PodConditionType) *v1.PodCondition {
	for i := range st.Conditions {
		if st.Conditions[i].Type == t {
			return &st.Conditions[i]
		}
	}
	return nil
}

func TestBuildTransitions(t *testing.T) {
	p := pod(v1.RestartPolicyNever)
	t0 := time.Now()
	now := metav1.NewTime(t0)
	view := &Pod{StartTime: &now, Init: []Container{{Name: "i", State: Waiting("PodInitializing", "")}},
		App: []Container{{Name: "a", State: Waiting("PodInitializing", "")}, {Name: "b", State: Waiting("PodInitializing", "")}}}

	// Pending: sandbox not ready, init not done.
	st := Build(p, view, t0)
	if st.Phase != v1.PodPending || st.QOSClass != v1.PodQOSBestEffort || st.PodIP != "127.0.0.1" || len(st.HostIPs) != 1 {
		t.Fatalf("pending status: %+v", st)
	}
	if c := cond(st, v1.PodInitialized); c.Status != v1.ConditionFalse || c.Message != "containers with incomplete status: [i]" {
		t.Errorf("Initialized: %+v", c)
	}
	if c := cond(st, "example.com/gate"); c == nil || c.Status != v1.ConditionTrue {
		t.Error("conditions owned by others must be kept")
	}
	if st.Conditions[0].Type != v1.PodScheduled {
		t.Errorf("PodScheduled first: %v", st.Conditions)
	}

	// Running and ready.
	p.Status = st
	view.SandboxReady, view.InitDone = true, true
	view.Init[0].State = exited(0)
	view.App[0] = Container{Name: "a", State: running(), Ready: true, Started: true}
	view.App[1] = Container{Name: "b", State: running(), Ready: false, Started: true}
	t1 := t0.Add(time.Second)
	st = Build(p, view, t1)
	if st.Phase != v1.PodRunning {
		t.Fatalf("phase %s", st.Phase)
	}
	if c := cond(st, v1.ContainersReady); c.Status != v1.ConditionFalse || c.Message != "containers with unready status: [b]" {
		t.Errorf("ContainersReady: %+v", c)
	}
	if c := cond(st, v1.PodReadyToStartContainers); c.Status != v1.ConditionTrue || !c.LastTransitionTime.Time.Equal(t1.Truncate(time.Second)) && c.LastTransitionTime.Time.Before(t0) {
		t.Errorf("PodReadyToStartContainers: %+v", c)
	}
	p.Status = st
	view.App[1].Ready = true
	t2 := t1.Add(time.Second)
	st = Build(p, view, t2)
	ready := cond(st, v1.PodReady)
	if ready.Status != v1.ConditionTrue {
		t.Errorf("Ready: %+v", ready)
	}
	init := cond(st, v1.PodInitialized)
	if prev := cond(p.Status, v1.PodInitialized); !init.LastTransitionTime.Equal(&prev.LastTransitionTime) {
		t.Error("an unchanged condition keeps its transition time")
	}

	// A readiness gate that is not true keeps the pod unready.
	gated := p.DeepCopy()
	gated.Spec.ReadinessGates = []v1.PodReadinessGate{{ConditionType: "example.com/missing"}}
	if c := cond(Build(gated, view, t2), v1.PodReady); c.Status != v1.ConditionFalse || c.Reason != "ReadinessGatesNotReady" {
		t.Errorf("readiness gate: %+v", c)
	}

	// Failed with exit code 3.
	p.Status = st
	view.App[0] = Container{Name: "a", State: exited(0)}
	view.App[1] = Container{Name: "b", State: exited(3)}
	view.SandboxClosed = true
	st = Build(p, view, t2.Add(time.Second))
	if st.Phase != v1.PodFailed {
		t.Fatalf("phase %s", st.Phase)
	}
	if st.ContainerStatuses[1].State.Terminated.ExitCode != 3 || st.ContainerStatuses[1].Name != "b" {
		t.Errorf("container statuses: %+v", st.ContainerStatuses)
	}
	if c := cond(st, v1.ContainersReady); c.Reason != "PodCompleted" || c.Status != v1.ConditionFalse {
		t.Errorf("ContainersReady after completion: %+v", c)
	}
	if c := cond(st, v1.PodReadyToStartContainers); c.Status != v1.ConditionFalse {
		t.Errorf("sandbox closed: %+v", c)
	}
	if st.InitContainerStatuses[0].Started == nil {
		t.Error("started must always be set")
	}
}
