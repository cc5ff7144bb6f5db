package console

import (
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/console/access"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// testPassword is every test user's password.
const testPassword = "correct horse battery staple"

// testUsers are an operator, alice, and a viewer, victor, with cheap hashes
// (the real 600000 rounds would make every login take a second under -race).
func testUsers(t testing.TB) []access.User {
	t.Helper()
	var users []access.User
	for _, u := range []struct{ name, role string }{{"alice", access.Operator}, {"victor", access.Viewer}} {
		h, err := access.HashPasswordIterations(testPassword, 10000)
		if err != nil {
			t.Fatal(err)
		}
		users = append(users, access.User{Name: u.name, Role: u.role, Hash: h})
	}
	return users
}

// testConfig is a console's configuration for tests: the two users, a fixed
// key, payloads shown, TARGET_TOPICS orders.*,payments.*.
func testConfig(t testing.TB) Config {
	targets := protocol.TargetPatterns{"orders.*", "payments.*"}
	return Config{Users: testUsers(t), SessionKey: []byte(strings.Repeat("k", 32)), PayloadPreview: true,
		TargetAllowed: targets.Allows, TargetTopics: "orders.*,payments.*", LoginDelay: time.Millisecond,
		OverviewEvery: time.Nanosecond}
}

// serve starts the console on pool with cfg.
func serve(t testing.TB, cfg Config, pool *pgxpool.Pool) *httptest.Server {
	t.Helper()
	h, err := New(cfg, pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// client is a browser of one user: a cookie jar that does not follow
// redirects, so tests see them.
type client struct {
	t    testing.TB
	srv  *httptest.Server
	http *http.Client
	csrf string
}

func newClient(t testing.TB, srv *httptest.Server) *client {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &client{t: t, srv: srv, http: &http.Client{Jar: jar, Timeout: 60 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

// login logs in as user and reads the CSRF token off the overview.
func login(t testing.TB, srv *httptest.Server, user string) *client {
	t.Helper()
	c := newClient(t, srv)
	resp := c.post("/login", url.Values{"user": {user}, "password": {testPassword}})
	if resp.code != http.StatusSeeOther {
		t.Fatalf("login as %s: %d\n%s", user, resp.code, resp.body)
	}
	page := c.get("/")
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(page.body)
	if m == nil {
		t.Fatalf("no csrf token on the overview:\n%s", page.body)
	}
	c.csrf = m[1]
	return c
}

type response struct {
	code   int
	body   string
	header http.Header
}

func (c *client) do(req *http.Request) response {
	c.t.Helper()
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return response{resp.StatusCode, string(b), resp.Header}
}

func (c *client) get(path string) response {
	c.t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, c.srv.URL+path, nil)
	if err != nil {
		c.t.Fatal(err)
	}
	return c.do(req)
}

// post sends a form as is (add the token with act).
func (c *client) post(path string, form url.Values) response {
	c.t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, c.srv.URL+path, strings.NewReader(form.Encode()))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return c.do(req)
}

// act posts an action form with the session's CSRF token.
func (c *client) act(action string, form url.Values) response {
	c.t.Helper()
	f := url.Values{}
	for k, v := range form {
		f[k] = v
	}
	f.Set("csrf", c.csrf)
	return c.post("/actions/"+action, f)
}

// mustHave fails unless body contains every want.
func mustHave(t testing.TB, what string, r response, code int, want ...string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("%s: status %d, want %d\n%s", what, r.code, code, r.body)
	}
	for _, w := range want {
		if !strings.Contains(r.body, w) {
			t.Errorf("%s: page lacks %q\n%s", what, w, r.body)
		}
	}
}
