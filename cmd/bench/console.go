package main

import (
	"context"
	"crypto/rand"
	_ "embed"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/console"
)

// The console scenario's seed, in the order it runs (see each file).
var (
	//go:embed console_seed_delivered.sql
	seedDeliveredSQL string
	//go:embed console_seed_messages.sql
	seedMessagesSQL string
	//go:embed console_seed_parks.sql
	seedParksSQL string
	//go:embed console_seed_recorded.sql
	seedRecordedSQL string
	//go:embed console_seed_finish.sql
	seedFinishSQL string
	//go:embed console_pick.sql
	consolePickSQL string
	//go:embed console_counts.sql
	consoleCountsSQL string
)

// consoleBudget is the p95 every console page should stay under, with the
// database at ConsoleRows messages. It is reported against, not asserted.
const consoleBudget = 250 * time.Millisecond

// consoleChunk is how many messages one seed statement writes.
const consoleChunk = 100_000

// consoleUser logs in to the console under test; a viewer, since the
// scenario only reads.
const consoleUser, consolePassword = "bench", "bench-password"

// consolePage is one page the scenario times.
type consolePage struct {
	name string // RESULT key part
	path string // with its query
	d    []time.Duration
	size int // bytes of the last answer
}

// consoleResult is what the console scenario measured.
type consoleResult struct {
	rows                                   int
	seed                                   []seedStep
	messages, parked, rejected, keys, hist int64
	pages                                  []*consolePage
}

// seedStep is one step of the seed and how long it took.
type seedStep struct {
	what string
	took time.Duration
}

func (r consoleResult) seedTotal() time.Duration {
	var d time.Duration
	for _, s := range r.seed {
		d += s.took
	}
	return d
}

// over returns the pages whose p95 is over consoleBudget.
func (r consoleResult) over() []string {
	var out []string
	for _, p := range r.pages {
		if percentile(p.d, 0.95) > consoleBudget {
			out = append(out, p.name)
		}
	}
	return out
}

// runConsole seeds a fresh database with ConsoleRows messages shaped like a
// production backlog (seedConsole), starts the operator console in this
// process on it (console.New, served over loopback HTTP), logs in as a
// viewer, and requests each page ConsoleRequests times, one request at a
// time after one untimed request, timing each client side: the database's
// queries, the rendering and the transfer. The overview's counts are cached
// for OverviewEvery in the console; here they are recounted on every
// request, so its figure is the count's cost, not the cache's.
func (b *bench) runConsole(ctx context.Context) (res consoleResult, err error) {
	res.rows = b.cfg.ConsoleRows
	db, err := b.pg.fresh(ctx, "console")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	if res.seed, err = seedConsole(ctx, db, res.rows, b.say); err != nil {
		return res, err
	}
	if err := db.pool.QueryRow(ctx, consoleCountsSQL).Scan(&res.messages, &res.parked, &res.rejected, &res.keys, &res.hist); err != nil {
		return res, fmt.Errorf("count the seeded rows: %w", err)
	}
	var msgID int64
	var key string
	if err := db.pool.QueryRow(ctx, consolePickSQL).Scan(&msgID, &key); err != nil {
		return res, fmt.Errorf("pick a message and a key to show: %w", err)
	}

	hash, err := console.HashPassword(consolePassword)
	if err != nil {
		return res, err
	}
	users, err := console.ParseUsers(consoleUser + ":viewer:" + hash)
	if err != nil {
		return res, err
	}
	sessionKey := make([]byte, 32)
	if _, err := rand.Read(sessionKey); err != nil {
		return res, fmt.Errorf("session key: %w", err)
	}
	h, err := console.New(console.Config{Users: users, SessionKey: sessionKey, PayloadPreview: true,
		OverviewEvery: time.Nanosecond}, db.pool, slog.New(slog.DiscardHandler))
	if err != nil {
		return res, fmt.Errorf("start the console: %w", err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	c, err := consoleLogin(ctx, srv.URL)
	if err != nil {
		return res, err
	}

	firstDue, err := c.get(ctx, "/messages?sort=due")
	if err != nil {
		return res, err
	}
	next, err := nextPage(firstDue)
	if err != nil {
		return res, fmt.Errorf("GET /messages?sort=due: %w", err)
	}
	res.pages = []*consolePage{
		{name: "overview", path: "/"},
		{name: "overview_json", path: "/api/overview"},
		{name: "messages", path: "/messages"},
		{name: "messages_due", path: "/messages?sort=due"},
		{name: "messages_due_page2", path: next},
		{name: "messages_newest", path: "/messages?sort=newest"},
		{name: "messages_target", path: "/messages?target=" + url.QueryEscape("team07.*")},
		{name: "messages_state", path: "/messages?state=parked"},
		{name: "messages_reason", path: "/messages?reason=unknown_topic"},
		{name: "messages_key", path: "/messages?key=" + url.QueryEscape(key)},
		{name: "messages_error_class", path: "/messages?error_class=" + url.QueryEscape("Rate*")},
		{name: "messages_since", path: "/messages?since=1h&sort=newest"},
		{name: "message", path: "/messages/" + strconv.FormatInt(msgID, 10)},
		{name: "key", path: "/keys?key=" + url.QueryEscape(key)},
		{name: "parked", path: "/parked"},
		{name: "rejected", path: "/rejected"},
		{name: "targets", path: "/targets"},
	}
	b.say("  timing %d pages, %d requests each", len(res.pages), b.cfg.ConsoleRequests)
	for _, p := range res.pages {
		// One untimed request: the pool's connections and their plan
		// caches, and the table pages the query reads, warm up.
		if _, err := c.get(ctx, p.path); err != nil {
			return res, err
		}
		for range b.cfg.ConsoleRequests {
			start := time.Now()
			body, err := c.get(ctx, p.path)
			if err != nil {
				return res, err
			}
			p.d = append(p.d, time.Since(start))
			p.size = len(body)
		}
		b.say("    %-22s p50 %6.1fms  p95 %6.1fms  %s", p.name, ms(percentile(p.d, 0.5)), ms(percentile(p.d, 0.95)), p.path)
	}
	return res, nil
}

// seedConsole fills db with n messages, their keys and history: the
// delivered messages' history first (their ids are the live messages'
// origins), then the live messages, then the parks that follow a store,
// then the dates of the live messages' history, then the controls, each in chunks of consoleChunk on a new connection
// after ANALYZE, as fillBacklog does and for the same reason (the
// triggers' plans). It returns how long each step took.
func seedConsole(ctx context.Context, db *database, n int, say func(string, ...any)) ([]seedStep, error) {
	var steps []seedStep
	for _, s := range []struct {
		what  string
		sql   string
		total bool // takes n as $3
	}{
		{"history of delivered messages (deferred_attempt)", seedDeliveredSQL, true},
		{"messages (deferred_message; the triggers write deferred_key and history)", seedMessagesSQL, true},
		{"parks by dispatch and operators (UPDATE)", seedParksSQL, false},
		{"history dated (UPDATE deferred_attempt)", seedRecordedSQL, false},
	} {
		start := time.Now()
		for from := 1; from <= n; from += consoleChunk {
			to := min(from+consoleChunk-1, n)
			args := []any{from, to}
			if s.total {
				args = append(args, n)
			}
			if err := seedChunk(ctx, db.url, s.sql, args...); err != nil {
				return steps, fmt.Errorf("seed the console's database, %s, rows %d..%d: %w", s.what, from, to, err)
			}
		}
		steps = append(steps, seedStep{s.what, time.Since(start)})
		say("  seeded %s in %.1fs", s.what, time.Since(start).Seconds())
	}
	start := time.Now()
	if _, err := db.pool.Exec(ctx, seedFinishSQL, 2*n); err != nil {
		return steps, fmt.Errorf("seed the console's database, target controls: %w", err)
	}
	if _, err := db.pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return steps, fmt.Errorf("vacuum analyze after the console's seed: %w", err)
	}
	steps = append(steps, seedStep{"target controls, VACUUM ANALYZE", time.Since(start)})
	say("  target controls and VACUUM ANALYZE in %.1fs", time.Since(start).Seconds())
	return steps, nil
}

func seedChunk(ctx context.Context, dbURL, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "ANALYZE"); err != nil {
		return fmt.Errorf("analyze: %w", err)
	}
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// consoleClient is a logged-in browser, as far as cookies go.
type consoleClient struct {
	base string
	http *http.Client
}

// consoleLogin logs in at base's /login and returns a client carrying the
// session cookie.
func consoleLogin(ctx context.Context, base string) (*consoleClient, error) {
	jar, err := cookiejar.New(nil)
	if err != nil {
		return nil, err
	}
	c := &consoleClient{base: base, http: &http.Client{Jar: jar, Timeout: 2 * time.Minute,
		// Every answer is checked as it comes: a redirect to /login is a
		// lost session, not a page.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	form := url.Values{"user": {consoleUser}, "password": {consolePassword}, "next": {"/"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/login", strings.NewReader(form.Encode()))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("log in to the console: %w", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther {
		return nil, fmt.Errorf("log in to the console: %s, want 303 See Other:\n%.2000s", resp.Status, body)
	}
	return c, nil
}

// get requests path and returns the body; any status but 200 is an error
// with the start of the page, which says what went wrong.
func (c *consoleClient) get(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s:\n%.2000s", path, resp.Status, body)
	}
	return body, nil
}

// nextLink finds the next-page link of a messages page.
var nextLink = regexp.MustCompile(`href="(/messages\?[^"]*cursor=[^"]*)"`)

// nextPage returns the path of the messages page after the one in body.
func nextPage(body []byte) (string, error) {
	m := nextLink.FindSubmatch(body)
	if m == nil {
		return "", errors.New("no next-page link (href=\"/messages?...cursor=...\") in the page")
	}
	return html.UnescapeString(string(m[1])), nil
}

// summarize adds the scenario's figures to s.
func (r consoleResult) summarize(s *summary) {
	s.set("console_rows", float64(r.rows))
	s.set("console_seed_s", r.seedTotal().Seconds())
	s.set("console_parked", float64(r.parked))
	s.set("console_rejected", float64(r.rejected))
	s.set("console_keys", float64(r.keys))
	s.set("console_history", float64(r.hist))
	var worst time.Duration
	for _, p := range r.pages {
		p95 := percentile(p.d, 0.95)
		worst = max(worst, p95)
		s.set("console_"+p.name+"_p95_ms", ms(p95))
	}
	s.set("console_worst_p95_ms", ms(worst))
	s.set("console_pages_over_budget", float64(len(r.over())))
}

// write prints the scenario's section of the report.
func (r consoleResult) write(w io.Writer, requests int) {
	fmt.Fprintf(w, "\nCONSOLE PAGES: internal/console in this process on %s messages (%s pending, %s parked, %s rejected; %s keys;\n",
		group(float64(r.messages)), group(float64(r.messages-r.parked-r.rejected)), group(float64(r.parked)), group(float64(r.rejected)), group(float64(r.keys)))
	fmt.Fprintf(w, "%s history events), a viewer logged in; each page requested %d times one after the other after one untimed request,\n",
		group(float64(r.hist)), requests)
	fmt.Fprintln(w, "timed client side over loopback HTTP (queries, rendering, transfer); the overview recounted on every request")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "page\tp50\tp95\tmax\tbytes\tp95 budget\tpath")
	for _, p := range r.pages {
		verdict := "met"
		if percentile(p.d, 0.95) > consoleBudget {
			verdict = "OVER"
		}
		fmt.Fprintf(tw, "%s\t%.1fms\t%.1fms\t%.1fms\t%s\t%s\t%s\n", p.name, ms(percentile(p.d, 0.5)), ms(percentile(p.d, 0.95)),
			ms(percentile(p.d, 1)), group(float64(p.size)), verdict, p.path)
	}
	tw.Flush()
	if over := r.over(); len(over) > 0 {
		fmt.Fprintf(w, "pages over the %v p95 budget: %s\n", consoleBudget, strings.Join(over, ", "))
	} else {
		fmt.Fprintf(w, "every page within the %v p95 budget\n", consoleBudget)
	}
	fmt.Fprintf(w, "seeded with SQL in %.1fs (cmd/bench/console_seed_*.sql, in chunks of %s messages):\n", r.seedTotal().Seconds(), group(consoleChunk))
	for _, s := range r.seed {
		fmt.Fprintf(w, "  %6.1fs  %s\n", s.took.Seconds(), s.what)
	}
}

// consoleTargets adds the scenario's row to the targets table.
func consoleTargets(target func(what, got, want string, ok bool), v map[string]float64) {
	target(fmt.Sprintf("console pages at %s messages, worst p95", group(v["console_rows"])),
		fmt.Sprintf("%.1f ms", v["console_worst_p95_ms"]), fmt.Sprintf("<= %d ms", consoleBudget.Milliseconds()),
		v["console_worst_p95_ms"] <= float64(consoleBudget.Milliseconds()))
}
