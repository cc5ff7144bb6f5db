package ingest

import (
	"testing"

	"github.com/deferq/scheduler/internal/pgtest"
)

// TestMain gives the package's database tests a server and a migrated
// template, and removes what they created at the end.
func TestMain(m *testing.M) { pgtest.Main(m) }
