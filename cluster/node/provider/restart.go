package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"fuseforge.dev/cluster/node/runtime"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
)

// CleanStateDir removes what an earlier run of the node left behind after a
// crash: surviving container process groups, then the pod directories.
func CleanStateDir(stateDir string) error {
	podsDir := filepath.Join(stateDir, "pods")
	entries, _ := os.ReadDir(podsDir)
	for _, e := range entries {
		podDir := filepath.Join(podsDir, e.Name())
		cs, _ := os.ReadDir(filepath.Join(podDir, "containers"))
		for _, c := range cs {
			runtime.KillRecorded(filepath.Join(podDir, "containers", c.Name()))
		}
		unmountUnder(podDir)
		if err := os.RemoveAll(podDir); err != nil {
			return err
		}
	}
	return os.MkdirAll(podsDir, 0o700)
}

// unmountUnder detaches the node's own mounts (pod tmpfs) below dir.
func unmountUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mps []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			mps = append(mps, f[4])
		}
	}
	for i := len(mps) - 1; i >= 0; i-- {
		_ = unix.Unmount(mps[i], unix.MNT_DETACH)
	}
}

// MarkOrphans runs before the pod controller starts: pods bound to this node
// that a previous run had started are gone with it, so they are set Failed
// (reason NodeRestarted) and their controllers replace them. Pods that never
// started are left for the pod controller to run.
func MarkOrphans(ctx context.Context, client kubernetes.Interface, nodeName string) (int, error) {
	list, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", nodeName).String(),
	})
	if err != nil {
		return 0, err
	}
	n := 0
	for i := range list.Items {
		pod := &list.Items[i]
		if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
			continue
		}
		if pod.DeletionTimestamp != nil {
			opts := metav1.DeleteOptions{GracePeriodSeconds: new(int64), Preconditions: metav1.NewUIDPreconditions(string(pod.UID))}
			if err := client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opts); err != nil && !apierrors.IsNotFound(err) {
				return n, err
			}
			continue
		}
		if pod.Status.StartTime == nil && pod.Status.Phase != v1.PodRunning {
			continue
		}
		pod.Status = orphanStatus(pod.Status)
		if _, err := client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return n, fmt.Errorf("marking %s/%s failed: %w", pod.Namespace, pod.Name, err)
		}
		n++
	}
	return n, nil
}

func orphanStatus(st v1.PodStatus) v1.PodStatus {
	now := metav1.Now()
	st.Phase = v1.PodFailed
	st.Reason = "NodeRestarted"
	st.Message = "The node restarted; this pod's processes did not survive it"
	gone := func(cs []v1.ContainerStatus) {
		for i := range cs {
			c := &cs[i]
			if c.State.Terminated != nil {
				continue
			}
			started := metav1.Time{}
			if c.State.Running != nil {
				started = c.State.Running.StartedAt
			}
			c.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
				ExitCode: 137, Reason: "ContainerStatusUnknown", StartedAt: started, FinishedAt: now,
				Message: "The container could not be located when the pod was terminated",
			}}
			c.Ready = false
			f := false
			c.Started = &f
		}
	}
	gone(st.InitContainerStatuses)
	gone(st.ContainerStatuses)
	for i := range st.Conditions {
		c := &st.Conditions[i]
		if (c.Type == v1.PodReady || c.Type == v1.ContainersReady || c.Type == v1.PodReadyToStartContainers) && c.Status != v1.ConditionFalse {
			c.Status, c.Reason, c.LastTransitionTime = v1.ConditionFalse, "NodeRestarted", now
		}
	}
	return st
}
