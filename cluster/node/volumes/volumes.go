// Package volumes materialises a pod's volumes as plain directories under the
// pod's state directory; the container runtime then bind-mounts them at their
// mount paths. Only what can be written as files (or bound from the host) is
// supported: anything that needs a storage driver fails the pod by name.
package volumes

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"fuseforge.dev/cluster/node/env"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// TokenSource issues service account tokens bound to the pod (TokenRequest).
type TokenSource interface {
	Token(pod *v1.Pod, serviceAccount string, audience string, expirationSeconds int64) (token string, expires time.Time, err error)
}

// UnsupportedError is a volume this node can never provide: the pod fails.
type UnsupportedError struct{ Msg string }

func (e *UnsupportedError) Error() string { return e.Msg }

// IsUnsupported tells whether err is permanent.
func IsUnsupported(err error) bool {
	var u *UnsupportedError
	return errors.As(err, &u)
}

// Volume is one materialised volume.
type Volume struct {
	Name string
	// Path is the host directory (or file, for hostPath) to bind at mount paths.
	Path string
	// Memory asks for a tmpfs at Path (emptyDir medium Memory), SizeLimit in bytes (0: none).
	Memory    bool
	SizeLimit int64
	// ReadOnlyKind marks volumes the kubelet treats as read-only content
	// (configMap, secret, downwardAPI, projected).
	ReadOnlyKind bool
	// Tokens are the service account tokens written into the volume, to be refreshed.
	Tokens []TokenFile
}

// TokenFile is a projected service account token to keep fresh.
type TokenFile struct {
	Path              string
	Audience          string
	ExpirationSeconds int64
	Mode              os.FileMode
	Expires           time.Time
	Issued            time.Time
}

// Materialiser writes volumes.
type Materialiser struct {
	Sources     env.Sources
	Tokens      TokenSource
	Allocatable v1.ResourceList
}

const defaultMode = 0o644

// Prepare materialises every volume of pod under dir (the pod's volumes
// directory). Memory-backed emptyDirs are only created as directories; the
// caller mounts the tmpfs. A transient error (a ConfigMap not there yet) can
// be retried; an UnsupportedError cannot.
func (m *Materialiser) Prepare(pod *v1.Pod, dir string) (map[string]*Volume, error) {
	out := map[string]*Volume{}
	for i := range pod.Spec.Volumes {
		vol := &pod.Spec.Volumes[i]
		if kind := unsupportedKind(vol); kind != "" {
			return nil, &UnsupportedError{fmt.Sprintf("volume %q: volume type %s is not supported by this node (it runs pods as host processes; supported: emptyDir, configMap, secret, downwardAPI, projected, hostPath)", vol.Name, kind)}
		}
	}
	for i := range pod.Spec.Volumes {
		vol := &pod.Spec.Volumes[i]
		v, err := m.prepareOne(pod, vol, filepath.Join(dir, vol.Name))
		if err != nil {
			return nil, err
		}
		out[vol.Name] = v
	}
	return out, nil
}

func (m *Materialiser) prepareOne(pod *v1.Pod, vol *v1.Volume, path string) (*Volume, error) {
	v := &Volume{Name: vol.Name, Path: path}
	fsGroup := fsGroupOf(pod)
	switch {
	case vol.EmptyDir != nil:
		if err := os.MkdirAll(path, 0o777); err != nil {
			return nil, err
		}
		if err := os.Chmod(path, 0o777); err != nil {
			return nil, err
		}
		if vol.EmptyDir.Medium == v1.StorageMediumMemory {
			v.Memory = true
			if vol.EmptyDir.SizeLimit != nil {
				v.SizeLimit = vol.EmptyDir.SizeLimit.Value()
			}
		}
		// fsGroup is applied by the caller after any tmpfs is mounted.
		return v, nil
	case vol.HostPath != nil:
		if err := checkHostPath(vol.HostPath); err != nil {
			return nil, fmt.Errorf("volume %q: %w", vol.Name, err)
		}
		v.Path = filepath.Clean(vol.HostPath.Path)
		return v, nil
	}
	files, tokens, err := m.contents(pod, vol)
	if err != nil {
		return nil, fmt.Errorf("volume %q: %w", vol.Name, err)
	}
	if err := writeAll(path, files); err != nil {
		return nil, fmt.Errorf("volume %q: %w", vol.Name, err)
	}
	for i := range tokens {
		tokens[i].Path = filepath.Join(path, tokens[i].Path)
	}
	v.Tokens = tokens
	v.ReadOnlyKind = true
	if fsGroup != nil {
		if err := ApplyFSGroup(path, *fsGroup, true); err != nil {
			return nil, fmt.Errorf("volume %q: fsGroup: %w", vol.Name, err)
		}
	}
	return v, nil
}

func fsGroupOf(pod *v1.Pod) *int64 {
	if pod.Spec.SecurityContext == nil {
		return nil
	}
	return pod.Spec.SecurityContext.FSGroup
}

func unsupportedKind(vol *v1.Volume) string {
	s := vol.VolumeSource
	switch {
	case s.EmptyDir != nil, s.ConfigMap != nil, s.Secret != nil, s.DownwardAPI != nil, s.Projected != nil, s.HostPath != nil:
		return ""
	case s.PersistentVolumeClaim != nil:
		return "persistentVolumeClaim"
	case s.Ephemeral != nil:
		return "ephemeral"
	case s.CSI != nil:
		return "csi"
	case s.NFS != nil:
		return "nfs"
	case s.Image != nil:
		return "image"
	case s.GitRepo != nil:
		return "gitRepo"
	}
	return "(other than emptyDir, configMap, secret, downwardAPI, projected, hostPath)"
}

func checkHostPath(hp *v1.HostPathVolumeSource) error {
	t := v1.HostPathUnset
	if hp.Type != nil {
		t = *hp.Type
	}
	st, err := os.Stat(hp.Path)
	switch t {
	case v1.HostPathUnset:
		return nil
	case v1.HostPathDirectoryOrCreate:
		if os.IsNotExist(err) {
			return os.MkdirAll(hp.Path, 0o755)
		}
		if err == nil && !st.IsDir() {
			return fmt.Errorf("hostPath %s is not a directory", hp.Path)
		}
		return err
	case v1.HostPathFileOrCreate:
		if os.IsNotExist(err) {
			if err := os.MkdirAll(filepath.Dir(hp.Path), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(hp.Path, os.O_CREATE|os.O_WRONLY, 0o644)
			if err != nil {
				return err
			}
			return f.Close()
		}
		if err == nil && st.IsDir() {
			return fmt.Errorf("hostPath %s is a directory, not a file", hp.Path)
		}
		return err
	}
	if err != nil {
		return fmt.Errorf("hostPath %s: %w", hp.Path, err)
	}
	mode := st.Mode()
	ok := true
	switch t {
	case v1.HostPathDirectory:
		ok = mode.IsDir()
	case v1.HostPathFile:
		ok = mode.IsRegular()
	case v1.HostPathSocket:
		ok = mode&os.ModeSocket != 0
	case v1.HostPathCharDev:
		ok = mode&os.ModeCharDevice != 0
	case v1.HostPathBlockDev:
		ok = mode&os.ModeDevice != 0 && mode&os.ModeCharDevice == 0
	}
	if !ok {
		return fmt.Errorf("hostPath %s is not of type %s", hp.Path, t)
	}
	return nil
}

// file is one file to write in a volume, relative to its root.
type file struct {
	path string
	data []byte
	mode os.FileMode
}

// contents computes the files of a configMap, secret, downwardAPI or
// projected volume.
func (m *Materialiser) contents(pod *v1.Pod, vol *v1.Volume) ([]file, []TokenFile, error) {
	s := vol.VolumeSource
	switch {
	case s.ConfigMap != nil:
		files, err := m.configMapFiles(pod, &s.ConfigMap.LocalObjectReference, s.ConfigMap.Items, s.ConfigMap.Optional, modeOr(s.ConfigMap.DefaultMode, defaultMode))
		return files, nil, err
	case s.Secret != nil:
		files, err := m.secretFiles(pod, s.Secret.SecretName, s.Secret.Items, s.Secret.Optional, modeOr(s.Secret.DefaultMode, defaultMode))
		return files, nil, err
	case s.DownwardAPI != nil:
		files, err := m.downwardFiles(pod, s.DownwardAPI.Items, modeOr(s.DownwardAPI.DefaultMode, defaultMode))
		return files, nil, err
	case s.Projected != nil:
		return m.projectedFiles(pod, s.Projected)
	}
	return nil, nil, fmt.Errorf("not a file volume")
}

func modeOr(m *int32, def os.FileMode) os.FileMode {
	if m == nil {
		return def
	}
	return os.FileMode(*m) & 0o777
}

func (m *Materialiser) configMapFiles(pod *v1.Pod, ref *v1.LocalObjectReference, items []v1.KeyToPath, opt *bool, mode os.FileMode) ([]file, error) {
	cm, err := m.Sources.ConfigMap(pod.Namespace, ref.Name)
	if err != nil {
		if apierrors.IsNotFound(err) && opt != nil && *opt {
			return nil, nil
		}
		return nil, fmt.Errorf("configmap %q: %w", ref.Name, err)
	}
	data := map[string][]byte{}
	for k, v := range cm.Data {
		data[k] = []byte(v)
	}
	for k, v := range cm.BinaryData {
		data[k] = v
	}
	return keyFiles("configmap", ref.Name, data, items, opt, mode)
}

func (m *Materialiser) secretFiles(pod *v1.Pod, name string, items []v1.KeyToPath, opt *bool, mode os.FileMode) ([]file, error) {
	s, err := m.Sources.Secret(pod.Namespace, name)
	if err != nil {
		if apierrors.IsNotFound(err) && opt != nil && *opt {
			return nil, nil
		}
		return nil, fmt.Errorf("secret %q: %w", name, err)
	}
	return keyFiles("secret", name, s.Data, items, opt, mode)
}

// keyFiles turns a key/value map into files: every key, or only the items asked for.
func keyFiles(kind, name string, data map[string][]byte, items []v1.KeyToPath, opt *bool, mode os.FileMode) ([]file, error) {
	var out []file
	if len(items) == 0 {
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			out = append(out, file{path: k, data: data[k], mode: mode})
		}
		return out, nil
	}
	for _, it := range items {
		v, ok := data[it.Key]
		if !ok {
			if opt != nil && *opt {
				continue
			}
			return nil, fmt.Errorf("configured to use key %s of %s %q, which does not exist", it.Key, kind, name)
		}
		out = append(out, file{path: it.Path, data: v, mode: modeOr(it.Mode, mode)})
	}
	return out, nil
}

func (m *Materialiser) downwardFiles(pod *v1.Pod, items []v1.DownwardAPIVolumeFile, mode os.FileMode) ([]file, error) {
	var out []file
	for _, it := range items {
		var val string
		var err error
		switch {
		case it.FieldRef != nil:
			val, err = env.FieldValue(pod, it.FieldRef.FieldPath)
		case it.ResourceFieldRef != nil:
			c := containerNamed(pod, it.ResourceFieldRef.ContainerName)
			if c == nil {
				return nil, fmt.Errorf("downwardAPI %s: no container %q", it.Path, it.ResourceFieldRef.ContainerName)
			}
			val, err = env.ResourceValue(pod, c, it.ResourceFieldRef, m.Allocatable)
		default:
			err = fmt.Errorf("downwardAPI %s: no fieldRef nor resourceFieldRef", it.Path)
		}
		if err != nil {
			return nil, err
		}
		out = append(out, file{path: it.Path, data: []byte(val), mode: modeOr(it.Mode, mode)})
	}
	return out, nil
}

func (m *Materialiser) projectedFiles(pod *v1.Pod, p *v1.ProjectedVolumeSource) ([]file, []TokenFile, error) {
	mode := modeOr(p.DefaultMode, defaultMode)
	var out []file
	var tokens []TokenFile
	for _, src := range p.Sources {
		switch {
		case src.ConfigMap != nil:
			f, err := m.configMapFiles(pod, &src.ConfigMap.LocalObjectReference, src.ConfigMap.Items, src.ConfigMap.Optional, mode)
			if err != nil {
				return nil, nil, err
			}
			out = append(out, f...)
		case src.Secret != nil:
			f, err := m.secretFiles(pod, src.Secret.Name, src.Secret.Items, src.Secret.Optional, mode)
			if err != nil {
				return nil, nil, err
			}
			out = append(out, f...)
		case src.DownwardAPI != nil:
			f, err := m.downwardFiles(pod, src.DownwardAPI.Items, mode)
			if err != nil {
				return nil, nil, err
			}
			out = append(out, f...)
		case src.ServiceAccountToken != nil:
			t := src.ServiceAccountToken
			exp := int64(3600)
			if t.ExpirationSeconds != nil {
				exp = *t.ExpirationSeconds
			}
			if m.Tokens == nil {
				return nil, nil, errors.New("no token source")
			}
			tok, expires, err := m.Tokens.Token(pod, serviceAccountOf(pod), t.Audience, exp)
			if err != nil {
				return nil, nil, fmt.Errorf("service account token: %w", err)
			}
			out = append(out, file{path: t.Path, data: []byte(tok), mode: mode})
			tokens = append(tokens, TokenFile{Path: t.Path, Audience: t.Audience, ExpirationSeconds: exp, Mode: mode, Expires: expires, Issued: time.Now()})
		case src.ClusterTrustBundle != nil:
			return nil, nil, &UnsupportedError{"projected clusterTrustBundle sources are not supported by this node"}
		case src.PodCertificate != nil:
			return nil, nil, &UnsupportedError{"projected podCertificate sources are not supported by this node"}
		}
	}
	return out, tokens, nil
}

func serviceAccountOf(pod *v1.Pod) string {
	if pod.Spec.ServiceAccountName != "" {
		return pod.Spec.ServiceAccountName
	}
	return "default"
}

func containerNamed(pod *v1.Pod, name string) *v1.Container {
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

// writeAll writes files below root, creating subdirectories; paths are
// validated by the API server, but a path leaving root is refused here too.
func writeAll(root string, files []file) error {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	for _, f := range files {
		clean := filepath.Clean(f.path)
		if filepath.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
			return fmt.Errorf("path %q leaves the volume", f.path)
		}
		if err := WriteFileAtomic(filepath.Join(root, clean), f.data, f.mode); err != nil {
			return err
		}
	}
	return nil
}

// WriteFileAtomic replaces a file by renaming a complete temporary one over
// it, so a reader in the container never sees a half-written token.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), mode); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// ApplyFSGroup gives the volume's files to group gid the way the kubelet does:
// group ownership, group read (and write unless readOnly) on files, setgid and
// group search on directories.
func ApplyFSGroup(root string, gid int64, readOnly bool) error {
	mask := os.FileMode(0o660)
	if readOnly {
		mask = 0o440
	}
	return filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if info.Mode()&os.ModeSymlink != 0 {
			return nil
		}
		if err := os.Lchown(p, -1, int(gid)); err != nil {
			return err
		}
		m := info.Mode().Perm() | mask
		if info.IsDir() {
			m |= os.ModeSetgid | 0o110
		}
		return os.Chmod(p, m|(info.Mode()&(os.ModeSetuid|os.ModeSticky)))
	})
}
