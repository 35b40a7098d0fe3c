package runtime

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Identity is the user a container runs as.
type Identity struct {
	UID    uint32
	GID    uint32
	Groups []uint32
	Home   string
}

// ResolveIdentity applies the pod's and container's securityContext to the
// "image" (this machine, whose default user is root). passwd and group are
// the contents of /etc/passwd and /etc/group. A runAsNonRoot container that
// would run as uid 0 is an error, as the kubelet reports it.
func ResolveIdentity(pod *v1.Pod, c *v1.Container, passwd, group []byte) (Identity, error) {
	var uid, gid *int64
	var supplemental []int64
	var fsGroup *int64
	var nonRoot *bool
	if psc := pod.Spec.SecurityContext; psc != nil {
		uid, gid, nonRoot, fsGroup = psc.RunAsUser, psc.RunAsGroup, psc.RunAsNonRoot, psc.FSGroup
		supplemental = psc.SupplementalGroups
	}
	if sc := c.SecurityContext; sc != nil {
		if sc.RunAsUser != nil {
			uid = sc.RunAsUser
		}
		if sc.RunAsGroup != nil {
			gid = sc.RunAsGroup
		}
		if sc.RunAsNonRoot != nil {
			nonRoot = sc.RunAsNonRoot
		}
	}
	id := Identity{Home: "/"}
	if uid != nil {
		id.UID = uint32(*uid)
	}
	if nonRoot != nil && *nonRoot && id.UID == 0 {
		if uid != nil {
			return id, fmt.Errorf("container's runAsUser breaks non-root policy (pod: %q, container: %s)", pod.Namespace+"/"+pod.Name, c.Name)
		}
		return id, fmt.Errorf("container has runAsNonRoot and image will run as root (pod: %q, container: %s)", pod.Namespace+"/"+pod.Name, c.Name)
	}
	name := ""
	for _, line := range strings.Split(string(passwd), "\n") {
		f := strings.Split(line, ":")
		if len(f) < 7 {
			continue
		}
		if u, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(u) == id.UID {
			name = f[0]
			if g, err := strconv.ParseUint(f[3], 10, 32); err == nil {
				id.GID = uint32(g)
			}
			id.Home = f[5]
			break
		}
	}
	if gid != nil {
		id.GID = uint32(*gid)
	}
	set := map[uint32]bool{}
	if name != "" {
		// Groups the image's /etc/group gives the user (supplementalGroupsPolicy Merge).
		for _, line := range strings.Split(string(group), "\n") {
			f := strings.Split(line, ":")
			if len(f) < 4 {
				continue
			}
			for _, m := range strings.Split(f[3], ",") {
				if m == name {
					if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
						set[uint32(g)] = true
					}
				}
			}
		}
	}
	for _, g := range supplemental {
		set[uint32(g)] = true
	}
	if fsGroup != nil {
		set[uint32(*fsGroup)] = true
	}
	delete(set, id.GID)
	for g := range set {
		id.Groups = append(id.Groups, g)
	}
	sort.Slice(id.Groups, func(i, j int) bool { return id.Groups[i] < id.Groups[j] })
	if id.UID == 0 && name == "" {
		id.Home = "/root"
	}
	return id, nil
}
