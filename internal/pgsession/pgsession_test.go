package pgsession

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestCarried(t *testing.T) {
	for _, tt := range []struct {
		params map[string]string
		want   string
	}{
		{nil, ""},
		{map[string]string{}, ""},
		{map[string]string{"jit": "off"}, "jit=off"},
		{map[string]string{"work_mem": "8MB", "jit": "off", "options": "-c lock_timeout=1s"},
			"jit=off, options=-c lock_timeout=1s, work_mem=8MB"},
	} {
		if got := Carried(tt.params); got != tt.want {
			t.Errorf("Carried(%v) = %q, want %q", tt.params, got, tt.want)
		}
	}
}

// Each way a real server refuses a setting of the startup message is
// reported as the connection string's, with the server's reason; a failure
// for another reason is left to the caller.
func TestRefused(t *testing.T) {
	admin := pgtest.AdminURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A role that may log in but is no superuser, for a setting only a
	// superuser may make.
	role := fmt.Sprintf("pgsession_%08x", rand.Uint32())
	adminConn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the drop, so that it runs after it.
	t.Cleanup(func() { adminConn.Close(context.Background()) })
	if _, err := adminConn.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := adminConn.Exec(context.Background(), "DROP ROLE "+role); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})

	// A database the role may not connect to.
	closed := pgtest.NewDB(t)
	if _, err := closed.Pool.Exec(ctx, "REVOKE CONNECT ON DATABASE "+closed.Name+" FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name  string
		user  string // empty: the admin URL's
		db    string // empty: the admin URL's
		query string
		// want is in the error Refused returns; empty: it must return nil.
		want []string
		code string // the server's SQLSTATE, where want is empty

	}{
		{name: "a bad value", query: "jit=sometimes",
			want: []string{"refused a session setting in DATABASE_URL (jit=sometimes)", `parameter "jit" requires a Boolean value`, "22023"}},
		{name: "a bad value in options", query: "options=-c%20jit%3Dsometimes",
			want: []string{"(options=-c jit=sometimes)", `parameter "jit" requires a Boolean value`}},
		{name: "an unknown name", query: "jitt=off",
			want: []string{"(jitt=off)", `unrecognized configuration parameter "jitt"`, "42704"}},
		{name: "a superuser's setting", user: role, query: "log_min_duration_statement=0",
			want: []string{"(log_min_duration_statement=0)", `permission denied to set parameter "log_min_duration_statement"`, "42501"}},
		{name: "a superuser's setting in options", user: role, query: "options=-c%20log_min_duration_statement%3D0",
			want: []string{"(options=-c log_min_duration_statement=0)", `permission denied to set parameter "log_min_duration_statement"`}},
		{name: "another failure, with settings", query: "jit=off", user: role + "_nobody", code: "28000"},
		// 42501 too, but for the database, not a setting.
		{name: "no CONNECT on the database, with settings", user: role, db: closed.Name, query: "jit=off", code: "42501"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u, err := url.Parse(admin)
			if err != nil {
				t.Fatalf("the test server's URL: %v", err)
			}
			if tt.user != "" {
				u.User = url.User(tt.user)
			}
			if tt.db != "" {
				u.Path = "/" + tt.db
			}
			if u.RawQuery != "" {
				u.RawQuery += "&"
			}
			u.RawQuery += tt.query
			cc, err := pgx.ParseConfig(u.String())
			if err != nil {
				t.Fatal(err)
			}
			carried := Carried(cc.RuntimeParams)
			conn, err := pgx.ConnectConfig(ctx, cc)
			if err == nil {
				conn.Close(ctx)
				t.Fatalf("connected with %s as %s; want the server to refuse", tt.query, u.User.Username())
			}
			got := Refused(err, "DATABASE_URL", cc.Host, cc.Port, carried)
			if tt.want == nil {
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != tt.code {
					t.Fatalf("connecting failed with %v; want SQLSTATE %s", err, tt.code)
				}
				if got != nil {
					t.Fatalf("Refused(%v) = %v, want nil: not a refused setting", err, got)
				}
				return
			}
			if got == nil {
				t.Fatalf("Refused(%v) = nil, want an error naming the settings", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(got.Error(), w) {
					t.Errorf("Refused: %q does not contain %q", got, w)
				}
			}
			if !strings.Contains(got.Error(), fmt.Sprintf("the database at %s:%d", cc.Host, cc.Port)) {
				t.Errorf("Refused: %q does not name the server", got)
			}
		})
	}
}

func TestQuotesName(t *testing.T) {
	for _, tt := range []struct {
		message, carried string
		want             bool
	}{
		{`permission denied to set parameter "log_min_duration_statement"`, "log_min_duration_statement=0", true},
		{`permission denied to set parameter "log_min_duration_statement"`, "options=-c log_min_duration_statement=0 -c jit=off", true},
		{`permission denied to set parameter "log_statement"`, "jit=off, options=-c log_statement=all", true},
		{`permission denied for database "jit"`, "jit=off", true}, // a database named as a setting: named as the settings' too
		{`permission denied for database "orders"`, "jit=off", false},
		{`permission denied for database "orders"`, "options=-c work_mem=8MB", false},
	} {
		if got := quotesName(tt.message, tt.carried); got != tt.want {
			t.Errorf("quotesName(%q, %q) = %v, want %v", tt.message, tt.carried, got, tt.want)
		}
	}
}

// Setting finds a setting in every form a real server takes, and only
// there, with the value the server ends with: each case's connection string
// is given to the server, which must agree about lock_timeout.
func TestSetting(t *testing.T) {
	admin := pgtest.AdminURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tt := range []struct {
		name  string
		query string // added to the test server's URL, as written there
		want  string // lock_timeout's value; empty: not set
	}{
		{"nothing", "", ""},
		{"a parameter of its own", "lock_timeout=3s", "3s"},
		{"a parameter in capitals", "LOCK_TIMEOUT=3s", "3s"},
		{"another parameter", "jit=off", ""},
		{"-c name=value", "options=" + escape("-c lock_timeout=3s"), "3s"},
		{"-cname=value", "options=" + escape("-clock_timeout=3s"), "3s"},
		{"--name=value", "options=" + escape("--lock_timeout=3s"), "3s"},
		{"--name-with-dashes=value", "options=" + escape("--lock-timeout=3s"), "3s"},
		{"-c NAME=value", "options=" + escape("-c LOCK_TIMEOUT=3s"), "3s"},
		{"among others", "options=" + escape("-c jit=off  -c lock_timeout=3s --work_mem=8MB"), "3s"},
		{"twice in options: the last", "options=" + escape("-c lock_timeout=3s -c lock_timeout=4s"), "4s"},
		{"in options and of its own: its own", "options=" + escape("-c lock_timeout=3s") + "&lock_timeout=4s", "4s"},
		{"others only", "options=" + escape("-c jit=off -c statement_timeout=3s"), ""},
		{"in another's value", "options=" + escape("-c application_name=lock_timeout=3s"), ""},
		{"behind an escaped space", "options=" + escape(`-c application_name=x\ -c\ lock_timeout=3s`), ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			connString := admin
			if tt.query != "" {
				connString = pgtest.WithQuery(t, admin, tt.query)
			}
			cc, err := pgx.ParseConfig(connString)
			if err != nil {
				t.Fatal(err)
			}
			if got, ok := Setting(cc.RuntimeParams, "lock_timeout"); got != tt.want || ok != (tt.want != "") {
				t.Errorf("Setting(%v, lock_timeout) = %q, %v; want %q", cc.RuntimeParams, got, ok, tt.want)
			}
			conn, err := pgx.ConnectConfig(ctx, cc)
			if err != nil {
				t.Fatalf("connect with %s: %v", tt.query, err)
			}
			defer conn.Close(ctx)
			var server string
			if err := conn.QueryRow(ctx, "SHOW lock_timeout").Scan(&server); err != nil {
				t.Fatal(err)
			}
			if want := cmp.Or(tt.want, "0"); server != want {
				t.Errorf("the server's lock_timeout is %s with %s; want %s", server, tt.query, want)
			}
		})
	}
}

// ReadCommitted keeps a connection string's own READ COMMITTED, adds
// nothing where the string says nothing (internal/pgconnect asks the
// server), and refuses any other level it asks for, naming it.
func TestReadCommitted(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	for _, tt := range []struct {
		name, query string // query: added to the database's URL; empty: none
		refused     string // in the error; empty: none, and the connection is READ COMMITTED
	}{
		{"nothing", "", ""},
		{"read committed of its own", "default_transaction_isolation=read%20committed", ""},
		{"READ COMMITTED in options", "options=" + escape(`-c default_transaction_isolation=READ\ COMMITTED`), ""},
		{"read uncommitted", "default_transaction_isolation=read%20uncommitted", ""},
		{"repeatable read", "default_transaction_isolation=repeatable%20read",
			"DATABASE_URL sets default_transaction_isolation=repeatable read; the scheduler needs read committed"},
		{"serializable in options", "options=" + escape("--default-transaction-isolation=serializable"),
			"DATABASE_URL sets default_transaction_isolation=serializable; the scheduler needs read committed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			connString := db.URL
			if tt.query != "" {
				connString = pgtest.WithQuery(t, db.URL, tt.query)
			}
			cc, err := pgx.ParseConfig(connString)
			if err != nil {
				t.Fatal(err)
			}
			err = ReadCommitted(cc.RuntimeParams, "DATABASE_URL")
			if tt.refused != "" {
				if err == nil || !strings.Contains(err.Error(), tt.refused) {
					t.Fatalf("ReadCommitted = %v, want an error containing %q", err, tt.refused)
				}
				return
			}
			if err != nil {
				t.Fatalf("ReadCommitted = %v", err)
			}
			if tt.query == "" {
				if len(cc.RuntimeParams) != 0 {
					t.Fatalf("ReadCommitted added %v to a string that set nothing", cc.RuntimeParams)
				}
				return
			}
			conn, err := pgx.ConnectConfig(ctx, cc)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			var level string
			if err := conn.QueryRow(ctx, "SELECT current_setting('transaction_isolation')").Scan(&level); err != nil {
				t.Fatal(err)
			}
			if level != "read committed" && level != "read uncommitted" {
				t.Errorf("transaction_isolation %q, want read committed", level)
			}
		})
	}
}

func TestSplitOptions(t *testing.T) {
	for _, tt := range []struct {
		options string
		want    []string
	}{
		{"", nil},
		{"   ", nil},
		{"-c jit=off", []string{"-c", "jit=off"}},
		{" -c\tjit=off \n--work_mem=8MB ", []string{"-c", "jit=off", "--work_mem=8MB"}},
		{`-c application_name=a\ b`, []string{"-c", "application_name=a b"}},
		{`-c search_path=\\x`, []string{"-c", `search_path=\x`}},
		{`\ `, []string{" "}},
	} {
		if got := splitOptions(tt.options); !slices.Equal(got, tt.want) {
			t.Errorf("splitOptions(%q) = %q, want %q", tt.options, got, tt.want)
		}
	}
}

// escape writes s as a URL's query value for both pgx and libpq: neither
// reads '+' as a space, and pgx refuses a bare '='.
func escape(s string) string {
	return strings.ReplaceAll(url.QueryEscape(s), "+", "%20")
}
