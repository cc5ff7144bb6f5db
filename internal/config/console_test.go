package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deferq/scheduler/internal/console/access"
)

// TestConsoleSettings reads the console's users from CONSOLE_USERS and
// CONSOLE_USERS_FILE, and its database from CONSOLE_DATABASE_URL or
// DATABASE_URL.
func TestConsoleSettings(t *testing.T) {
	h, err := access.HashPasswordIterations("pw", 10000)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "users")
	if err := os.WriteFile(file, []byte("# the on-call team\n\ncarol:operator:"+h+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := withEnv("CONSOLE_USERS=alice:operator:"+h+", bob:viewer:"+h, "CONSOLE_USERS_FILE="+file,
		"CONSOLE_SESSION_KEY="+strings.Repeat("ab", 32))
	cfg, err := Load(env)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, u := range cfg.ConsoleUserList() {
		got = append(got, u.Name+":"+u.Role)
	}
	if strings.Join(got, ",") != "alice:operator,bob:viewer,carol:operator" {
		t.Errorf("users %v", got)
	}
	if len(cfg.ConsoleKey()) != 32 || cfg.ConsoleDB() != cfg.DatabaseURL || !cfg.ConsolePayloadPreview || cfg.ConsoleAddr != "" {
		t.Errorf("key %d bytes, db %q, preview %v, addr %q", len(cfg.ConsoleKey()), cfg.ConsoleDB(), cfg.ConsolePayloadPreview, cfg.ConsoleAddr)
	}
	cfg, err = Load(append(env, "CONSOLE_DATABASE_URL=postgres://op@db/x", "CONSOLE_USERS_FILE=", "CONSOLE_USERS=alice:operator:"+h+",alice:viewer:"+h))
	if err == nil || !strings.Contains(err.Error(), "alice is already given by CONSOLE_USERS entry 1") {
		t.Errorf("duplicate user: %v", err)
	}
	if cfg.ConsoleDB() != "postgres://op@db/x" {
		t.Errorf("ConsoleDB %q", cfg.ConsoleDB())
	}
	if strings.Contains(err.Error(), h) || strings.Contains(err.Error(), "postgres://op") {
		t.Errorf("the error shows a secret: %v", err)
	}
}
