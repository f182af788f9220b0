module switchyard/helmrender

go 1.22
