package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"gopkg.in/yaml.v3"
)

// Settings is the `flyte:` section of the single binary's configuration (what runs).
type Settings struct {
	Admin struct {
		Disabled                      bool     `yaml:"disabled"`
		DisableScheduler              bool     `yaml:"disableScheduler"`
		DisableClusterResourceManager bool     `yaml:"disableClusterResourceManager"`
		SeedProjects                  []string `yaml:"seedProjects"`
		SeedProjectsWithDetails       []struct {
			Name string `yaml:"name"`
		} `yaml:"seedProjectsWithDetails"`
	} `yaml:"admin"`
	DataCatalog struct {
		Disabled bool `yaml:"disabled"`
	} `yaml:"dataCatalog"`
	Propeller struct {
		Disabled       bool `yaml:"disabled"`
		DisableWebhook bool `yaml:"disableWebhook"`
	} `yaml:"propeller"`
}

// configFiles expands the --config pattern the way Flyte's config loader does (a glob, sorted).
func configFiles(pattern string) ([]string, error) {
	files, err := filepath.Glob(pattern)
	if err != nil {
		return nil, fmt.Errorf("--config %q: %w", pattern, err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("--config %q matches no file", pattern)
	}
	sort.Strings(files)
	return files, nil
}

// loadSettings reads the `flyte:` section from every file; a later file's keys win.
func loadSettings(files []string) (Settings, error) {
	var settings Settings
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			return settings, err
		}
		var doc struct {
			Flyte yaml.Node `yaml:"flyte"`
		}
		if err := yaml.Unmarshal(data, &doc); err != nil {
			return settings, fmt.Errorf("%s: %w", file, err)
		}
		if doc.Flyte.Kind != 0 {
			if err := doc.Flyte.Decode(&settings); err != nil {
				return settings, fmt.Errorf("%s: flyte: %w", file, err)
			}
		}
	}
	return settings, nil
}

// seedProjects lists the projects to create, from both settings, once each.
func (s Settings) seedProjects() []string {
	seen := map[string]bool{}
	var names []string
	for _, name := range s.Admin.SeedProjects {
		if !seen[name] {
			seen[name], names = true, append(names, name)
		}
	}
	for _, project := range s.Admin.SeedProjectsWithDetails {
		if project.Name != "" && !seen[project.Name] {
			seen[project.Name], names = true, append(names, project.Name)
		}
	}
	return names
}
