package service

import (
	"testing"

	"github.com/deferq/scheduler/internal/config"
)

// The service sets Go's soft memory limit from its byte budgets, unless the
// operator set GOMEMLIMIT.
func TestMemoryLimit(t *testing.T) {
	defaults, err := config.Load(nil)
	if err != nil {
		t.Fatal(err)
	}
	bigger := defaults
	bigger.IngestBufferBytes = 256 << 20
	bigger.DispatchLoops = 8
	tests := []struct {
		name       string
		cfg        config.Config
		gomemlimit string
		want       int64
		set        bool
	}{
		{"defaults", defaults, "", 48<<20 + 3*32<<20/2 + 2*4*8<<20, true},
		{"larger budgets raise it", bigger, "", 48<<20 + 3*256<<20/2 + 2*8*8<<20, true},
		{"GOMEMLIMIT wins", defaults, "1GiB", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, set := memoryLimit(tt.cfg, tt.gomemlimit)
			if got != tt.want || set != tt.set {
				t.Errorf("memoryLimit = %d, %v; want %d, %v", got, set, tt.want, tt.set)
			}
		})
	}
	if got, _ := memoryLimit(defaults, ""); got > 256_000_000 {
		t.Errorf("the default limit %d bytes is above the documented 256 MB bound", got)
	}
}

// Under its own memory limit the service collects at GOGC=200, unless the
// operator set GOGC.
func TestGCPercent(t *testing.T) {
	for _, tt := range []struct {
		name string
		gogc string
		want int
		set  bool
	}{
		{"unset", "", 200, true},
		{"GOGC wins", "100", 0, false},
		{"GOGC=off wins", "off", 0, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got, set := gcPercent(tt.gogc); got != tt.want || set != tt.set {
				t.Errorf("gcPercent(%q) = %d, %v; want %d, %v", tt.gogc, got, set, tt.want, tt.set)
			}
		})
	}
}
