package volumes

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

type fakeSources struct {
	cms     map[string]*v1.ConfigMap
	secrets map[string]*v1.Secret
}

func (f fakeSources) ConfigMap(ns, name string) (*v1.ConfigMap, error) {
	if cm, ok := f.cms[name]; ok {
		return cm, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
}

func (f fakeSources) Secret(ns, name string) (*v1.Secret, error) {
	if s, ok := f.secrets[name]; ok {
		return s, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
}

type fakeTokens struct {
	n   int
	aud []string
}

func (f *fakeTokens) Token(pod *v1.Pod, sa, audience string, exp int64) (string, time.Time, error) {
	f.n++
	f.aud = append(f.aud, sa+"/"+audience)
	return "token-" + string(rune('0'+f.n)), time.Now().Add(time.Duration(exp) * time.Second), nil
}

func i32(v int32) *int32 { return &v }
func i64(v int64) *int64 { return &v }
func yes() *bool         { t := true; return &t }

func read(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func mode(t *testing.T, p string) os.FileMode {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode()
}

func TestPrepare(t *testing.T) {
	dir := t.TempDir()
	hostDir := t.TempDir()
	sizeLimit := resource.MustParse("16Mi")
	dirOrCreate := v1.HostPathDirectoryOrCreate
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u", Labels: map[string]string{"a": "1"}},
		Spec: v1.PodSpec{
			ServiceAccountName: "runner",
			Containers:         []v1.Container{{Name: "c", Resources: v1.ResourceRequirements{Limits: v1.ResourceList{v1.ResourceMemory: resource.MustParse("2Gi")}}}},
			Volumes: []v1.Volume{
				{Name: "scratch", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}},
				{Name: "shm", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{Medium: v1.StorageMediumMemory, SizeLimit: &sizeLimit}}},
				{Name: "cfg", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "cm"}}}},
				{Name: "cfg-items", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "cm"},
					DefaultMode: i32(0o600), Items: []v1.KeyToPath{{Key: "a.yaml", Path: "sub/renamed.yaml", Mode: i32(0o640)}, {Key: "b", Path: "b"}}}}},
				{Name: "sec", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "s", DefaultMode: i32(0o400)}}},
				{Name: "opt", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "absent", Optional: yes()}}},
				{Name: "down", VolumeSource: v1.VolumeSource{DownwardAPI: &v1.DownwardAPIVolumeSource{Items: []v1.DownwardAPIVolumeFile{
					{Path: "labels", FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.labels"}},
					{Path: "mem", ResourceFieldRef: &v1.ResourceFieldSelector{ContainerName: "c", Resource: "limits.memory", Divisor: resource.MustParse("1Mi")}},
				}}}},
				{Name: "kube-api-access-x", VolumeSource: v1.VolumeSource{Projected: &v1.ProjectedVolumeSource{DefaultMode: i32(0o644), Sources: []v1.VolumeProjection{
					{ServiceAccountToken: &v1.ServiceAccountTokenProjection{Path: "token", ExpirationSeconds: i64(3607), Audience: "api"}},
					{ConfigMap: &v1.ConfigMapProjection{LocalObjectReference: v1.LocalObjectReference{Name: "kube-root-ca.crt"}, Items: []v1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}},
					{DownwardAPI: &v1.DownwardAPIProjection{Items: []v1.DownwardAPIVolumeFile{{Path: "namespace", FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}}}},
				}}}},
				{Name: "host", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: filepath.Join(hostDir, "made"), Type: &dirOrCreate}}},
			},
		},
	}
	tokens := &fakeTokens{}
	m := &Materialiser{
		Sources: fakeSources{
			cms: map[string]*v1.ConfigMap{
				"cm":               {Data: map[string]string{"a.yaml": "x: 1", "b": "bee"}, BinaryData: map[string][]byte{"blob": {0, 1, 2}}},
				"kube-root-ca.crt": {Data: map[string]string{"ca.crt": "CA"}},
			},
			secrets: map[string]*v1.Secret{"s": {Data: map[string][]byte{"pw": []byte("hunter2")}}},
		},
		Tokens: tokens,
	}
	vols, err := m.Prepare(pod, dir)
	if err != nil {
		t.Fatal(err)
	}
	if v := vols["scratch"]; v.Memory || mode(t, v.Path).Perm() != 0o777 {
		t.Errorf("emptyDir: %+v mode %v", v, mode(t, v.Path))
	}
	if v := vols["shm"]; !v.Memory || v.SizeLimit != 16<<20 {
		t.Errorf("memory emptyDir: %+v", v)
	}
	checks := map[string]struct {
		content string
		mode    os.FileMode
	}{
		"cfg/a.yaml":                  {"x: 1", 0o644},
		"cfg/blob":                    {"\x00\x01\x02", 0o644},
		"cfg-items/sub/renamed.yaml":  {"x: 1", 0o640},
		"cfg-items/b":                 {"bee", 0o600},
		"sec/pw":                      {"hunter2", 0o400},
		"down/labels":                 {`a="1"`, 0o644},
		"down/mem":                    {"2048", 0o644},
		"kube-api-access-x/token":     {"token-1", 0o644},
		"kube-api-access-x/ca.crt":    {"CA", 0o644},
		"kube-api-access-x/namespace": {"ns", 0o644},
	}
	for p, want := range checks {
		full := filepath.Join(dir, p)
		if got := read(t, full); got != want.content {
			t.Errorf("%s = %q, want %q", p, got, want.content)
		}
		if got := mode(t, full).Perm(); got != want.mode {
			t.Errorf("%s mode %o, want %o", p, got, want.mode)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "cfg-items", "a.yaml")); !os.IsNotExist(err) {
		t.Error("items must limit the keys written")
	}
	if entries, _ := os.ReadDir(filepath.Join(dir, "opt")); len(entries) != 0 {
		t.Errorf("optional missing secret: want an empty volume, got %v", entries)
	}
	if v := vols["host"]; v.Path != filepath.Join(hostDir, "made") || mode(t, v.Path)&os.ModeDir == 0 {
		t.Errorf("hostPath DirectoryOrCreate: %+v", v)
	}
	if !vols["sec"].ReadOnlyKind || vols["scratch"].ReadOnlyKind {
		t.Error("configMap/secret volumes are read-only content, emptyDir is not")
	}
	if tokens.aud[0] != "runner/api" || len(vols["kube-api-access-x"].Tokens) != 1 {
		t.Errorf("token request: %v %+v", tokens.aud, vols["kube-api-access-x"].Tokens)
	}

	// Refresh: nothing is due now; at 80% of the lifetime the token is renewed in place.
	v := vols["kube-api-access-x"]
	next, err := m.RefreshTokens(pod, v, time.Now())
	if err != nil || tokens.n != 1 || time.Until(next) < 40*time.Minute {
		t.Errorf("early refresh: next in %s, %d requests, %v", time.Until(next), tokens.n, err)
	}
	if _, err := m.RefreshTokens(pod, v, next.Add(time.Second)); err != nil || tokens.n != 2 {
		t.Fatalf("due refresh: %d requests, %v", tokens.n, err)
	}
	if got := read(t, filepath.Join(dir, "kube-api-access-x", "token")); got != "token-2" {
		t.Errorf("refreshed token file = %q", got)
	}
}

func TestPrepareErrors(t *testing.T) {
	m := &Materialiser{Sources: fakeSources{cms: map[string]*v1.ConfigMap{"cm": {Data: map[string]string{"a": "1"}}}}, Tokens: &fakeTokens{}}
	mk := func(vs ...v1.Volume) *v1.Pod {
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"}, Spec: v1.PodSpec{Volumes: vs}}
	}
	_, err := m.Prepare(mk(v1.Volume{Name: "data", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: "c"}}}), t.TempDir())
	if !IsUnsupported(err) || !strings.Contains(err.Error(), "persistentVolumeClaim") || !strings.Contains(err.Error(), `"data"`) {
		t.Errorf("PVC: %v", err)
	}
	// A missing ConfigMap is transient (it may be created later), not unsupported.
	_, err = m.Prepare(mk(v1.Volume{Name: "c", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "later"}}}}), t.TempDir())
	if err == nil || IsUnsupported(err) || !apierrors.IsNotFound(err) {
		t.Errorf("missing configmap: %v", err)
	}
	_, err = m.Prepare(mk(v1.Volume{Name: "c", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: "cm"},
		Items: []v1.KeyToPath{{Key: "nope", Path: "x"}}}}}), t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("missing item key: %v", err)
	}
	file := v1.HostPathFile
	_, err = m.Prepare(mk(v1.Volume{Name: "h", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: t.TempDir(), Type: &file}}}), t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "not of type File") {
		t.Errorf("hostPath type check: %v", err)
	}
}

func TestApplyFSGroup(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "f"), []byte("x"), 0o400); err != nil {
		t.Fatal(err)
	}
	gid := int64(os.Getgid())
	if err := ApplyFSGroup(dir, gid, true); err != nil {
		t.Fatal(err)
	}
	if m := mode(t, filepath.Join(dir, "sub", "f")); m.Perm() != 0o440 {
		t.Errorf("file mode %v, want 0440 (group read added)", m)
	}
	if m := mode(t, filepath.Join(dir, "sub")); m&os.ModeSetgid == 0 || m.Perm()&0o050 != 0o050 {
		t.Errorf("dir mode %v, want setgid and group r-x", m)
	}
	st, _ := os.Stat(filepath.Join(dir, "sub", "f"))
	if int64(st.Sys().(*syscall.Stat_t).Gid) != gid {
		t.Error("group ownership not applied")
	}
	if err := ApplyFSGroup(dir, gid, false); err != nil {
		t.Fatal(err)
	}
	if m := mode(t, filepath.Join(dir, "sub", "f")); m.Perm() != 0o660 {
		t.Errorf("writable volume: file mode %v, want 0660", m)
	}
}
