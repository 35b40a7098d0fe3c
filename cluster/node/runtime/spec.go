// Package runtime runs one container as a host process: the node re-executes
// its own binary as `node run-container SPEC` in new mount and UTS
// namespaces; that child builds the container's root (an overlay of the host's
// /), mounts the pod's volumes, drops to the container's user and execs the
// command. "The image" is therefore this machine's own filesystem.
package runtime

import (
	"encoding/json"
	"os"
)

// SubcommandName is the argv[1] that selects the container child.
const SubcommandName = "run-container"

// Mount is one bind mount into the container's root.
type Mount struct {
	Source   string `json:"source"`
	Target   string `json:"target"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}

// File is written into the container's root (in the overlay, never on the host).
type File struct {
	Path    string `json:"path"`
	Content string `json:"content"`
	Mode    uint32 `json:"mode"`
}

// Spec is everything the child needs; the node writes it as JSON.
type Spec struct {
	ID string `json:"id"`
	// StateDir is hidden inside the container (it holds every pod's secrets,
	// and the overlay's own upper directory cannot be looked at through it).
	StateDir string `json:"stateDir"`
	// Dir is the container instance's directory: root/, upper/, work/,
	// devupper/, devwork/ live there.
	Dir      string `json:"dir"`
	Hostname string `json:"hostname,omitempty"`
	// SetHostname is true when the container has its own UTS namespace.
	SetHostname bool    `json:"setHostname,omitempty"`
	ShmSource   string  `json:"shmSource,omitempty"`
	Mounts      []Mount `json:"mounts,omitempty"`
	Files       []File  `json:"files,omitempty"`
	WorkingDir  string  `json:"workingDir,omitempty"`
	// OwnedDir is created (if missing) and given to UID:GID before the user
	// changes: the image user's WORKDIR.
	OwnedDir string `json:"ownedDir,omitempty"`
	// Traversable directories get o+x in the container's root (overlay copy-up).
	Traversable []string `json:"traversable,omitempty"`
	// Argv[0] is looked up in the container's PATH when it has no slash.
	Argv         []string `json:"argv"`
	Env          []string `json:"env"`
	UID          uint32   `json:"uid"`
	GID          uint32   `json:"gid"`
	Groups       []uint32 `json:"groups,omitempty"`
	ReadOnlyRoot bool     `json:"readOnlyRoot,omitempty"`
	NoNewPrivs   bool     `json:"noNewPrivs,omitempty"`
	// ParentPID lets the child notice that the node died before it could
	// re-arm its parent-death signal (which a uid change clears).
	ParentPID int `json:"parentPid"`
}

// Write stores spec at path, readable by root only (it holds secret values).
func (s *Spec) Write(path string) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

// ReadSpec loads a spec written by Write.
func ReadSpec(path string) (*Spec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := &Spec{}
	return s, json.Unmarshal(b, s)
}
