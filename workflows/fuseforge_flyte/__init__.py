"""fuseforge on Flyte: config, image, training engine, tasks and workflows."""
