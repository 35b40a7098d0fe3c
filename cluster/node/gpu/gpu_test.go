package gpu

import (
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

func withGPUs(name string, n int64) v1.Container {
	return v1.Container{Name: name, Resources: v1.ResourceRequirements{Limits: v1.ResourceList{Resource: *resource.NewQuantity(n, resource.DecimalSI)}}}
}

func TestAllocate(t *testing.T) {
	a := New(4)
	p1 := &v1.Pod{Spec: v1.PodSpec{
		InitContainers: []v1.Container{withGPUs("init", 1)},
		Containers:     []v1.Container{withGPUs("a", 2), {Name: "cpu-only"}},
	}}
	got, err := a.Allocate("ns/p1", p1)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got["a"], []int{0, 1}) || len(got["cpu-only"]) != 0 || !reflect.DeepEqual(got["init"], []int{0}) {
		t.Errorf("p1: %v", got)
	}
	p2 := &v1.Pod{Spec: v1.PodSpec{Containers: []v1.Container{withGPUs("x", 1), withGPUs("y", 1)}}}
	got, err = a.Allocate("ns/p2", p2)
	if err != nil || !reflect.DeepEqual(got["x"], []int{2}) || !reflect.DeepEqual(got["y"], []int{3}) {
		t.Errorf("p2: %v %v", got, err)
	}
	if _, err := a.Allocate("ns/p3", &v1.Pod{Spec: v1.PodSpec{Containers: []v1.Container{withGPUs("z", 1)}}}); err == nil {
		t.Error("over-allocation must fail")
	}
	a.Release("ns/p1")
	got, err = a.Allocate("ns/p3", &v1.Pod{Spec: v1.PodSpec{Containers: []v1.Container{withGPUs("z", 2)}}})
	if err != nil || !reflect.DeepEqual(got["z"], []int{0, 1}) {
		t.Errorf("after release: %v %v", got, err)
	}
	if Visible([]int{3, 1}) != "1,3" || Visible(nil) != "" {
		t.Error("Visible")
	}
}
