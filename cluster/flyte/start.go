package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// service is one Flyte program run by `start`; ports moves its profiling server off the port the
// others use (in the single binary they share one process and one profiling server).
type service struct {
	name  string
	argv  []string
	ports string
}

const stopGrace = 20 * time.Second

func start(pattern string) int {
	files, err := configFiles(pattern)
	if err != nil {
		return fail(err)
	}
	settings, err := loadSettings(files)
	if err != nil {
		return fail(err)
	}
	scratch, err := os.MkdirTemp("", "flyte-start-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(scratch)

	var setup []service
	var services []service
	if !settings.Admin.Disabled {
		setup = append(setup, service{name: "admin-migrate", argv: []string{"flyteadmin", "migrate", "run"}})
		if projects := settings.seedProjects(); len(projects) > 0 {
			setup = append(setup, service{name: "admin-seed", argv: append([]string{"flyteadmin", "migrate", "seed-projects"}, projects...)})
		}
		services = append(services, service{name: "admin", argv: []string{"flyteadmin", "serve"}})
		if !settings.Admin.DisableScheduler {
			services = append(services, service{name: "scheduler", argv: []string{"flytescheduler", "run"},
				ports: "scheduler:\n  profilerPort: 10263\n"})
		}
		if !settings.Admin.DisableClusterResourceManager {
			services = append(services, service{name: "clusterresource", argv: []string{"flyteadmin", "clusterresource", "run"},
				ports: "flyteadmin:\n  profilerPort: 10262\n"})
		}
	}
	if !settings.DataCatalog.Disabled {
		setup = append(setup, service{name: "datacatalog-migrate", argv: []string{"datacatalog", "migrate", "run"},
			ports: "datacatalog:\n  profiler-port: 10264\n"})
		services = append(services, service{name: "datacatalog", argv: []string{"datacatalog", "serve"},
			ports: "datacatalog:\n  profiler-port: 10264\n"})
	}
	if !settings.Propeller.Disabled {
		services = append(services, service{name: "propeller", argv: []string{"flytepropeller"},
			ports: "propeller:\n  prof-port: 10265\n"})
		if !settings.Propeller.DisableWebhook {
			setup = append(setup, service{name: "webhook-certs", argv: []string{"flytepropeller", "webhook", "init-certs"},
				ports: "propeller:\n  prof-port: 10266\n"})
			services = append(services, service{name: "webhook", argv: []string{"flytepropeller", "webhook"},
				ports: "propeller:\n  prof-port: 10266\n"})
		}
	}

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)

	for _, step := range setup {
		cmd, err := launch(step, files, scratch)
		if err != nil {
			return fail(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				return fail(fmt.Errorf("%s: %w", step.name, err))
			}
		case sig := <-signals:
			_ = cmd.Process.Signal(sig)
			<-done
			return 0
		}
	}

	type exit struct {
		name string
		err  error
	}
	exits := make(chan exit, len(services))
	running := map[string]*exec.Cmd{}
	for _, svc := range services {
		cmd, err := launch(svc, files, scratch)
		if err != nil {
			stopAll(running, exits, len(running))
			return fail(err)
		}
		running[svc.name] = cmd
		go func(name string) { exits <- exit{name, cmd.Wait()} }(svc.name)
	}
	fmt.Fprintf(os.Stderr, "flyte: started %d services\n", len(running))

	select {
	case sig := <-signals:
		fmt.Fprintf(os.Stderr, "flyte: %v, stopping every service\n", sig)
		stopAll(running, exits, len(running))
		return 0
	case first := <-exits:
		fmt.Fprintf(os.Stderr, "flyte: %s exited (%v), stopping the others\n", first.name, first.err)
		delete(running, first.name)
		stopAll(running, exits, len(running))
		if code := exitCode(first.err); code != 0 {
			return code
		}
		return 1
	}
}

// launch starts one service with the shared configuration files plus its port file, its output
// prefixed with its name.
func launch(svc service, files []string, scratch string) (*exec.Cmd, error) {
	binary, err := exec.LookPath(svc.argv[0])
	if err != nil {
		return nil, fmt.Errorf("%s: %w", svc.name, err)
	}
	folder := filepath.Join(scratch, svc.name)
	if err := os.MkdirAll(folder, 0o700); err != nil {
		return nil, err
	}
	for _, file := range files {
		link := filepath.Join(folder, filepath.Base(file))
		if _, err := os.Lstat(link); err != nil {
			if err := os.Symlink(file, link); err != nil {
				return nil, err
			}
		}
	}
	if svc.ports != "" {
		if err := os.WriteFile(filepath.Join(folder, "zzz-"+svc.name+"-ports.yaml"), []byte(svc.ports), 0o600); err != nil {
			return nil, err
		}
	}
	args := append(append([]string{}, svc.argv[1:]...), "--config", filepath.Join(folder, "*.yaml"))
	cmd := exec.Command(binary, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = cmd.Stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", svc.name, err)
	}
	go prefixLines(svc.name, stdout)
	return cmd, nil
}

var outputLock sync.Mutex

func prefixLines(name string, r io.Reader) {
	scanner := bufio.NewScanner(r)
	scanner.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for scanner.Scan() {
		outputLock.Lock()
		fmt.Fprintf(os.Stdout, "[%s] %s\n", name, scanner.Bytes())
		outputLock.Unlock()
	}
}

// stopAll sends SIGTERM to every running service's process group, then SIGKILL after stopGrace,
// and collects `pending` exits.
func stopAll[T any](running map[string]*exec.Cmd, exits <-chan T, pending int) {
	for _, cmd := range running {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	}
	deadline := time.After(stopGrace)
	for pending > 0 {
		select {
		case <-exits:
			pending--
		case <-deadline:
			for _, cmd := range running {
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			}
			deadline = nil
		}
	}
}

func exitCode(err error) int {
	if exitErr, ok := err.(*exec.ExitError); ok {
		return exitErr.ExitCode()
	}
	return 0
}

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "flyte:", err)
	return 1
}
