package pgtest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { Main(m) }

func TestNewDBIndependent(t *testing.T) {
	a, b := NewDB(t), NewDB(t)
	if a.Name == b.Name {
		t.Fatalf("two NewDB calls returned the same database %s", a.Name)
	}
	ctx := t.Context()
	for _, db := range []DB{a, b} {
		var current string
		if err := db.Pool.QueryRow(ctx, "SELECT current_database()").Scan(&current); err != nil {
			t.Fatalf("%s: %v", db.Name, err)
		}
		if current != db.Name {
			t.Errorf("pool of %s is connected to %s", db.Name, current)
		}
		if !tableExists(ctx, t, db, "scheduler_migration") {
			t.Errorf("%s: table scheduler_migration missing; migrations not applied to the template", db.Name)
		}
	}

	if _, err := a.Pool.Exec(ctx, "CREATE TABLE only_in_a (id int)"); err != nil {
		t.Fatal(err)
	}
	if tableExists(ctx, t, b, "only_in_a") {
		t.Errorf("table created in %s is visible in %s", a.Name, b.Name)
	}

	// The URL must reach the same database as the pool.
	conn, err := pgx.Connect(ctx, a.URL)
	if err != nil {
		t.Fatalf("connect to DB.URL %s: %v", a.URL, err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM only_in_a").Scan(&n); err != nil {
		t.Errorf("DB.URL does not reach %s: %v", a.Name, err)
	}
}

func TestNewDBDroppedAfterTest(t *testing.T) {
	var name string
	t.Run("inner", func(t *testing.T) { name = NewDB(t).Name })
	var exists bool
	pool, err := adminPool()
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(t.Context(), "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("database %s still exists after its test ended", name)
	}
}

func TestParallelClones(t *testing.T) {
	for i := range 4 {
		t.Run("", func(t *testing.T) {
			t.Parallel()
			db := NewDB(t)
			if !tableExists(t.Context(), t, db, "scheduler_migration") {
				t.Errorf("clone %d (%s): scheduler_migration missing", i, db.Name)
			}
		})
	}
}

func TestWithDatabase(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:p@h:5432/postgres?sslmode=disable", "postgres://u:p@h:5432/t_x?sslmode=disable"},
		{"postgresql://h/", "postgresql://h/t_x"},
		{"host=h dbname=postgres", "host=h dbname=postgres dbname=t_x"},
	} {
		got, err := withDatabase(tc.in, "t_x")
		if err != nil || got != tc.want {
			t.Errorf("withDatabase(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestWithQuery(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"postgres://u@h:5432/db?sslmode=disable", "postgres://u@h:5432/db?sslmode=disable&jit=off"},
		{"postgresql://h/db", "postgresql://h/db?jit=off"},
	} {
		if got := WithQuery(t, tc.in, "jit=off"); got != tc.want {
			t.Errorf("WithQuery(%q) = %q; want %q", tc.in, got, tc.want)
		}
	}
}

func tableExists(ctx context.Context, t *testing.T, db DB, table string) bool {
	t.Helper()
	var ok bool
	if err := db.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&ok); err != nil {
		t.Fatalf("%s: look for table %s: %v", db.Name, table, err)
	}
	return ok
}

// A default set on the database reaches the sessions opened after it,
// quotes in the value included.
func TestSetDefault(t *testing.T) {
	db := NewDB(t)
	db.SetDefault(t, "application_name", "it's a test")
	conn, err := pgx.Connect(t.Context(), db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var got string
	if err := conn.QueryRow(t.Context(), "SELECT current_setting('application_name')").Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != "it's a test" {
		t.Errorf("application_name %q, want the database's default", got)
	}
}
