package console

import (
	"bytes"
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/console/access"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestNoUsers: with no user configured the console lets no one in, and
// every path says how to configure access.
func TestNoUsers(t *testing.T) {
	db := pgtest.NewDB(t)
	cfg := testConfig(t)
	cfg.Users = nil
	srv := serve(t, cfg, db.Pool)
	c := newClient(t, srv)
	for _, path := range []string{"/", "/login", "/messages/1", "/api/overview", "/nowhere"} {
		mustHave(t, path, c.get(path), http.StatusServiceUnavailable, "CONSOLE_USERS", "hash-password", `id="error"`)
	}
	mustHave(t, "POST /login", c.post("/login", url.Values{"user": {"alice"}, "password": {testPassword}}),
		http.StatusServiceUnavailable, "CONSOLE_USERS")
	mustHave(t, "POST /actions/cancel", c.post("/actions/cancel", url.Values{"ids": {"1"}}), http.StatusServiceUnavailable, "CONSOLE_USERS")
}

// TestSecurityHeaders checks the headers of every kind of response.
func TestSecurityHeaders(t *testing.T) {
	db := pgtest.NewDB(t)
	srv := serve(t, testConfig(t), db.Pool)
	anon := newClient(t, srv)
	c := login(t, srv, "alice")
	for _, tt := range []struct {
		name string
		r    response
	}{
		{"login page", anon.get("/login")},
		{"redirect to login", anon.get("/messages")},
		{"401 JSON", anon.get("/api/overview")},
		{"overview", c.get("/")},
		{"JSON", c.get("/api/overview")},
		{"404", c.get("/messages/999")},
		{"static", c.get("/static/console.js")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := tt.r.header
			for name, want := range map[string]string{
				"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
			} {
				if got := h.Get(name); got != want {
					t.Errorf("%s = %q, want %q", name, got, want)
				}
			}
			csp := h.Get("Content-Security-Policy")
			for _, w := range []string{"default-src 'self'", "script-src 'self'", "frame-ancestors 'none'"} {
				if !strings.Contains(csp, w) {
					t.Errorf("Content-Security-Policy %q lacks %q", csp, w)
				}
			}
			if strings.Contains(csp, "unsafe-inline") {
				t.Errorf("Content-Security-Policy allows inline code: %q", csp)
			}
			if tt.name != "static" && h.Get("Cache-Control") != "no-store" {
				t.Errorf("Cache-Control = %q, want no-store", h.Get("Cache-Control"))
			}
		})
	}
	if r := c.get("/static/"); r.code != http.StatusNotFound {
		t.Errorf("/static/ lists its directory: %d", r.code)
	}
	for _, bad := range []Config{{SessionKey: []byte("short")}, {Users: []access.User{{Name: "x", Role: "admin"}}}} {
		if _, err := New(bad, db.Pool, nil); err == nil {
			t.Errorf("New(%+v) accepted a bad configuration", bad)
		}
	}
	// No inline script anywhere: the script is a static file.
	if page := c.get("/"); strings.Contains(page.body, "<script>") || !strings.Contains(page.body, `<script src="/static/console.js"`) {
		t.Errorf("the overview has inline script or lacks the static one:\n%s", page.body)
	}
}

func TestLogin(t *testing.T) {
	db := pgtest.NewDB(t)
	cfg := testConfig(t)
	srv := serve(t, cfg, db.Pool)

	for _, tt := range []struct{ name, user, password string }{
		{"wrong password", "alice", "nope"},
		{"unknown user", "mallory", testPassword},
		{"empty", "", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t, srv)
			r := c.post("/login", url.Values{"user": {tt.user}, "password": {tt.password}})
			mustHave(t, "login", r, http.StatusUnauthorized, "wrong user or password", `id="error"`)
			if len(r.header.Values("Set-Cookie")) > 0 {
				t.Errorf("a failed login set a cookie: %v", r.header.Values("Set-Cookie"))
			}
			if c.get("/").code != http.StatusSeeOther {
				t.Error("a failed login let the user in")
			}
		})
	}

	t.Run("success, back to where it was going", func(t *testing.T) {
		c := newClient(t, srv)
		r := c.get("/parked?target=x")
		if r.code != http.StatusSeeOther || r.header.Get("Location") != "/login?next="+url.QueryEscape("/parked?target=x") {
			t.Fatalf("unauthenticated page: %d Location %q", r.code, r.header.Get("Location"))
		}
		mustHave(t, "login form", c.get("/login?next=%2Fparked%3Ftarget%3Dx"), 200, `name="user"`, `name="password"`, `value="/parked?target=x"`)
		r = c.post("/login", url.Values{"user": {"alice"}, "password": {testPassword}, "next": {"/parked?target=x"}})
		if r.code != http.StatusSeeOther || r.header.Get("Location") != "/parked?target=x" {
			t.Fatalf("login: %d Location %q", r.code, r.header.Get("Location"))
		}
		cookie := r.header.Get("Set-Cookie")
		for _, w := range []string{cookieName + "=", "HttpOnly", "SameSite=Strict", "Path=/"} {
			if !strings.Contains(cookie, w) {
				t.Errorf("cookie %q lacks %s", cookie, w)
			}
		}
		if strings.Contains(cookie, "Secure") {
			t.Errorf("cookie %q is Secure on plain HTTP without CONSOLE_COOKIE_SECURE", cookie)
		}
		mustHave(t, "parked", c.get("/parked?target=x"), 200, `id="parked"`)
	})

	t.Run("no open redirect", func(t *testing.T) {
		c := newClient(t, srv)
		r := c.post("/login", url.Values{"user": {"alice"}, "password": {testPassword}, "next": {"//evil.example/"}})
		if loc := r.header.Get("Location"); loc != "/" {
			t.Errorf("Location %q, want /", loc)
		}
	})

	t.Run("Secure cookie when asked", func(t *testing.T) {
		cfg := cfg
		cfg.CookieSecure = true
		c := newClient(t, serve(t, cfg, db.Pool))
		r := c.post("/login", url.Values{"user": {"alice"}, "password": {testPassword}})
		if !strings.Contains(r.header.Get("Set-Cookie"), "Secure") {
			t.Errorf("cookie %q is not Secure", r.header.Get("Set-Cookie"))
		}
	})

	t.Run("login from another site", func(t *testing.T) {
		c := newClient(t, srv)
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL+"/login",
			strings.NewReader(url.Values{"user": {"alice"}, "password": {testPassword}}.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Origin", "https://evil.example")
		mustHave(t, "cross-site login", c.do(req), http.StatusForbidden, "another origin")
	})
}

func TestUnauthenticated(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	srv := serve(t, testConfig(t), db.Pool)
	c := newClient(t, srv)
	for _, path := range []string{"/", "/messages", "/messages/101", "/keys?key=order-1", "/parked", "/rejected", "/targets"} {
		r := c.get(path)
		if r.code != http.StatusSeeOther || !strings.HasPrefix(r.header.Get("Location"), "/login?next=") {
			t.Errorf("GET %s: %d Location %q, want a redirect to /login", path, r.code, r.header.Get("Location"))
		}
	}
	r := c.get("/api/overview")
	mustHave(t, "JSON", r, http.StatusUnauthorized, `"error"`, "log in")
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	mustHave(t, "action", c.post("/actions/cancel", url.Values{"ids": {"101"}}), http.StatusUnauthorized, "not logged in", "nothing was changed")
	if n := fixture.Count(t, db.Pool, "id = 101"); n != 1 {
		t.Error("an unauthenticated cancel deleted message 101")
	}
}

// TestSessions: a forged, re-signed, expired or orphaned cookie is no
// session; logging out ends one.
func TestSessions(t *testing.T) {
	db := pgtest.NewDB(t)
	cfg := testConfig(t)
	srv := serve(t, cfg, db.Pool)
	s := &server{key: cfg.SessionKey}
	other := &server{key: bytes.Repeat([]byte("x"), 32)}
	future, past := time.Now().Add(time.Hour), time.Now().Add(-time.Second)
	good := s.cookieValue(&session{name: "alice", expires: future, id: "00"})
	tests := []struct {
		name, cookie string
		ok           bool
	}{
		{"valid", good, true},
		{"expired", s.cookieValue(&session{name: "alice", expires: past, id: "00"}), false},
		{"signed with another key", other.cookieValue(&session{name: "alice", expires: future, id: "00"}), false},
		{"user not configured", s.cookieValue(&session{name: "mallory", expires: future, id: "00"}), false},
		{"tampered", strings.Replace(good, good[:4], "AAAA", 1), false},
		{"no signature", strings.Split(good, ".")[0], false},
		{"garbage", "x.y", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t, srv)
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, srv.URL+"/", nil)
			req.AddCookie(&http.Cookie{Name: cookieName, Value: tt.cookie})
			r := c.do(req)
			if got := r.code == http.StatusOK; got != tt.ok {
				t.Errorf("status %d, want a session: %v", r.code, tt.ok)
			}
		})
	}

	t.Run("logout", func(t *testing.T) {
		c := login(t, srv, "victor")
		mustHave(t, "logout without token", c.post("/logout", url.Values{}), http.StatusForbidden, "CSRF")
		r := c.post("/logout", url.Values{"csrf": {c.csrf}})
		if r.code != http.StatusSeeOther || r.header.Get("Location") != "/login" {
			t.Fatalf("logout: %d %q", r.code, r.header.Get("Location"))
		}
		if r := c.get("/"); r.code != http.StatusSeeOther {
			t.Errorf("after logout: %d, want a redirect to /login", r.code)
		}
	})
}

// TestHashPassword checks the hash format and that only the password
// matches it.
func TestHashPassword(t *testing.T) {
	h, err := HashPassword("s3cret")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(h, "pbkdf2-sha256$600000$") || strings.Count(h, "$") != 3 {
		t.Errorf("hash %q: want pbkdf2-sha256$600000$<salt>$<key>", h)
	}
	if !access.Verify(h, "s3cret") || access.Verify(h, "s3cret ") || access.Verify(h, "") {
		t.Error("Verify accepts the wrong password or refuses the right one")
	}
	users, err := ParseUsers("alice:operator:" + h + ", bob:viewer:" + h)
	if err != nil || len(users) != 2 || users[1].Role != access.Viewer {
		t.Fatalf("ParseUsers: %v %v", users, err)
	}
	for _, tt := range []struct{ in, want string }{
		{"alice:admin:" + h, `role "admin": want viewer or operator`},
		{"alice:operator", "want name:role:hash"},
		{"alice:operator:md5$abc", "pbkdf2-sha256$<iterations>"},
		{"al ice:operator:" + h, "user name"},
		{"alice:operator:" + h + ",alice:viewer:" + h, "already given"},
		{"alice:operator:pbkdf2-sha256$10$c2FsdHNhbHQ$" + strings.Repeat("A", 43), "iterations"},
	} {
		if _, err := ParseUsers(tt.in); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseUsers(%.40q): %v, want an error with %q", tt.in, err, tt.want)
		} else if strings.Contains(err.Error(), h) {
			t.Errorf("the error quotes the hash: %v", err)
		}
	}
}

// TestHashPasswordCommand runs `scheduler console hash-password`.
func TestHashPasswordCommand(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := Command(context.Background(), []string{"hash-password"}, nil, strings.NewReader("hunter2\n"), &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if h := strings.TrimSpace(stdout.String()); !access.Verify(h, "hunter2") {
		t.Errorf("printed %q, which does not verify", h)
	}
	stdout.Reset()
	if code := Command(context.Background(), []string{"hash-password"}, nil, strings.NewReader(""), &stdout, &stderr); code != 2 || stdout.Len() > 0 {
		t.Errorf("empty password: exit %d, stdout %q", code, stdout.String())
	}
	stdout.Reset()
	if code := Command(context.Background(), []string{"--help"}, nil, nil, &stdout, &stderr); code != 0 ||
		!strings.Contains(stdout.String(), "Usage: scheduler console") || !strings.Contains(stdout.String(), "--addr") {
		t.Errorf("--help: exit %d\n%s", code, stdout.String())
	}
	stderr.Reset()
	if code := Command(context.Background(), nil, []string{"CONSOLE_USERS=alice:root:x"}, nil, &stdout, &stderr); code != 2 ||
		!strings.Contains(stderr.String(), "DATABASE_URL is not set") || !strings.Contains(stderr.String(), `role "root"`) {
		t.Errorf("bad configuration: exit %d\n%s", code, stderr.String())
	}
}
