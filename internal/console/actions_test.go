package console

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
)

// parkedEnv is a database whose parking lot was filled by a real
// dispatcher: each of keys holds a message to a topic the broker does not
// have (parked unknown_topic, holding its key) and a message behind it.
func parkedEnv(t *testing.T, target string, keys ...string) *dispatchtest.Env {
	t.Helper()
	e := dispatchtest.New(t)
	for _, k := range keys {
		e.Insert(
			fixture.Message{Key: fixture.Key(k), Target: target, RecordKey: []byte(k), Value: []byte(`{"k":"` + k + `"}`)},
			fixture.Message{Key: fixture.Key(k), Target: dispatchtest.TopicA, RecordKey: []byte(k), Value: []byte("behind")},
		)
	}
	d := e.Dispatcher("console-test", time.Minute, dispatchtest.AllowAll)
	e.Drain(d, 20*time.Second)
	if n := e.Count("state = 'parked' AND reason LIKE 'unknown_topic:%'"); n != len(keys) {
		t.Fatalf("%d parked unknown_topic messages, want %d", n, len(keys))
	}
	return e
}

var previewCount = regexp.MustCompile(`id="preview-count">(\d+)<`)

// count reads #preview-count.
func count(t *testing.T, r response) int {
	t.Helper()
	m := previewCount.FindStringSubmatch(r.body)
	if m == nil {
		t.Fatalf("no #preview-count:\n%s", r.body)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// hidden reads the hidden fields of the confirmation form of a preview, so
// that a test confirms exactly what the page would send.
func hidden(t *testing.T, r response) url.Values {
	t.Helper()
	i := strings.Index(r.body, `<form class="confirm"`)
	if i < 0 {
		t.Fatalf("the preview has no confirmation form:\n%s", r.body)
	}
	form := r.body[i:]
	form = form[:strings.Index(form, "</form>")]
	if !strings.Contains(form, `<button type="submit" name="confirm" value="1">`) {
		t.Fatalf("no button[name=confirm] in\n%s", form)
	}
	v := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`).FindAllStringSubmatch(form, -1) {
		v.Add(m[1], unescape(m[2]))
	}
	return v
}

func unescape(s string) string {
	return strings.NewReplacer("&#34;", `"`, "&#39;", "'", "&amp;", "&", "&lt;", "<", "&gt;", ">", "&#43;", "+").Replace(s)
}

// confirm posts a preview's confirmation form, plus extra fields.
func confirm(t *testing.T, c *client, action string, preview response, extra url.Values) response {
	t.Helper()
	f := hidden(t, preview)
	f.Del("csrf")
	for k, v := range extra {
		f[k] = v
	}
	f.Set("confirm", "1")
	return c.act(action, f)
}

// actorOf returns the actor of the last history event of message id.
func actorOf(t *testing.T, pool *pgxpool.Pool, id int64) string {
	t.Helper()
	ctx := context.Background()
	var actor *string
	if err := pool.QueryRow(ctx, `SELECT actor FROM deferred_attempt WHERE message_id = $1 ORDER BY id DESC LIMIT 1`, id).Scan(&actor); err != nil {
		t.Fatal(err)
	}
	return deref(actor)
}

// TestReplay replays a parking lot filled by a real refused publish:
// preview first (nothing changes), then the confirmation moves exactly
// the previewed messages, and the history names who did it.
func TestReplay(t *testing.T) {
	e := parkedEnv(t, "legacy.nosuch", "k1", "k2", "k3")
	cfg := testConfig(t)
	cfg.ConfirmAbove = 2
	srv := serve(t, cfg, e.Pool)
	c := login(t, srv, "alice")

	// The parking lot shows them, with a replay form per row.
	mustHave(t, "parked", c.get("/parked"), 200, `data-target="legacy.nosuch"`, `data-reason="unknown_topic"`, `form method="post" action="/actions/replay" data-action="replay"`)

	t.Run("no filter", func(t *testing.T) {
		mustHave(t, "replay without filter", c.act("replay", url.Values{"state": {"parked"}}), http.StatusBadRequest, "filters", "at least one filter", "Nothing was changed")
	})
	t.Run("matching nothing", func(t *testing.T) {
		r := c.act("replay", url.Values{"state": {"parked"}, "target": {"nothing.*"}})
		mustHave(t, "replay nothing", r, 200, `id="error"`, "No parked message matches")
		if count(t, r) != 0 || strings.Contains(r.body, `name="confirm"`) {
			t.Errorf("a preview of nothing offers to confirm:\n%s", r.body)
		}
	})
	t.Run("bad filters", func(t *testing.T) {
		for _, f := range []url.Values{
			{"state": {"pending"}, "target": {"*"}},
			{"reason": {"unknown_topic: x"}},
			{"since": {"yesterday"}},
			{"target": {"a[b"}},
			{"target": {"*"}, "rate": {"-1"}},
			{"ids": {"1,x"}},
		} {
			r := c.act("replay", f)
			if r.code != http.StatusBadRequest || !strings.Contains(r.body, "Bad input") {
				t.Errorf("replay %v: %d\n%s", f, r.code, r.body)
			}
		}
	})

	var preview response
	t.Run("preview changes nothing", func(t *testing.T) {
		preview = c.act("replay", url.Values{"state": {"parked"}, "target": {"legacy.*"}, "reason": {"unknown_topic"}, "rate": {"100"}})
		mustHave(t, "preview", preview, 200, "legacy.nosuch is outside TARGET_TOPICS", `id="preview-rows"`, `name="typed"`)
		if n := count(t, preview); n != 3 {
			t.Errorf("preview count %d, want 3", n)
		}
		if n := e.Count("state = 'parked'"); n != 3 {
			t.Errorf("%d parked after the preview, want 3", n)
		}
	})
	t.Run("above the threshold, the count must be typed", func(t *testing.T) {
		mustHave(t, "unconfirmed", confirm(t, c, "replay", preview, nil), http.StatusBadRequest, "type 3", "Nothing was changed")
		mustHave(t, "mistyped", confirm(t, c, "replay", preview, url.Values{"typed": {"30"}}), http.StatusBadRequest, "type 3")
		if n := e.Count("state = 'parked'"); n != 3 {
			t.Errorf("%d parked after unconfirmed replays, want 3", n)
		}
	})
	t.Run("confirmed", func(t *testing.T) {
		// One changes between the preview and the confirmation.
		var gone int64
		if err := e.Pool.QueryRow(context.Background(), `DELETE FROM deferred_message WHERE id = (SELECT min(id) FROM deferred_message WHERE state = 'parked') RETURNING id`).Scan(&gone); err != nil {
			t.Fatal(err)
		}
		r := confirm(t, c, "replay", preview, url.Values{"typed": {"3"}})
		mustHave(t, "replay", r, 200, `id="result"`, `id="result-count">2<`, "1 of the 3 previewed messages changed since the preview")
		if n := e.Count("state = 'pending' AND target_topic = 'legacy.nosuch' AND redrive_count = 1"); n != 2 {
			t.Errorf("%d replayed, want 2", n)
		}
		var id int64
		if err := e.Pool.QueryRow(context.Background(), `SELECT min(id) FROM deferred_message WHERE target_topic = 'legacy.nosuch'`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if a := actorOf(t, e.Pool, id); a != "console:alice" {
			t.Errorf("history actor %q, want console:alice", a)
		}
	})
}

// TestActions drives every other action through preview and confirmation
// on the runbook's seed.
func TestActions(t *testing.T) {
	ctx := context.Background()
	type step struct {
		name, action string
		form         url.Values
		// previewed is the preview's count; changed what the confirmation
		// changed, and check a query true afterwards (and false before).
		previewed int
		check     string
		want      []string
		// actor: the history of this message names the user afterwards.
		actor int64
	}
	steps := []step{
		{name: "expedite an id", action: "expedite", form: url.Values{"scope": {"id"}, "ids": {"102"}}, previewed: 1, actor: 102,
			check: "SELECT next_run_at <= now() FROM deferred_message WHERE id = 102"},
		{name: "expedite a key", action: "expedite", form: url.Values{"scope": {"key"}, "key": {"order-1"}}, previewed: 1,
			check: "SELECT next_run_at <= now() FROM deferred_message WHERE id = 102"},
		{name: "expedite a target", action: "expedite", form: url.Values{"scope": {"target"}, "target": {"payments.retry"}}, previewed: 1,
			check: "SELECT next_run_at <= now() FROM deferred_message WHERE id = 103"},
		{name: "cancel", action: "cancel", form: url.Values{"ids": {"103, 111"}}, previewed: 2, actor: 103,
			check: "SELECT count(*) = 0 FROM deferred_message WHERE id IN (103, 111)"},
		{name: "park", action: "park", form: url.Values{"ids": {"110"}, "why": {"ticket OPS-7"}}, previewed: 1, actor: 110,
			check: "SELECT state = 'parked' AND reason LIKE '%: ticket OPS-7' AND park_holds_key FROM deferred_message WHERE id = 110"},
		{name: "park releasing the key", action: "park", form: url.Values{"ids": {"110"}, "why": {"poison"}, "release": {"true"}}, previewed: 1,
			check: "SELECT state = 'parked' AND NOT park_holds_key FROM deferred_message WHERE id = 110"},
		{name: "fix a rejected record", action: "fix", form: url.Values{"ids": {"106"}, "target": {"orders.retry"}, "due": {"10m"}}, previewed: 1, actor: 106,
			check: "SELECT state = 'pending' AND target_topic = 'orders.retry' AND next_run_at > now() + interval '9 minutes' FROM deferred_message WHERE id = 106"},
		{name: "fix to a topic outside TARGET_TOPICS warns", action: "fix", form: url.Values{"ids": {"108"}, "target": {"audit.retry"}}, previewed: 1,
			want:  []string{"audit.retry is outside TARGET_TOPICS"},
			check: "SELECT state = 'pending' AND target_topic = 'audit.retry' FROM deferred_message WHERE id = 108"},
		{name: "requeue a rejected record unchanged", action: "replay", form: url.Values{"state": {"rejected"}, "ids": {"107"}}, previewed: 1, actor: 107,
			check: "SELECT state = 'pending' AND target_topic = 'orders.retry' FROM deferred_message WHERE id = 107"},
		{name: "pause", action: "pause", form: url.Values{"target": {"orders.retry"}, "note": {"INC-42"}}, previewed: 1,
			check: "SELECT paused AND note = 'INC-42' FROM target_control WHERE target_topic = 'orders.retry'"},
		{name: "pause outside TARGET_TOPICS warns", action: "pause", form: url.Values{"target": {"ordres.retry"}}, previewed: 1,
			want:  []string{"ordres.retry is outside TARGET_TOPICS"},
			check: "SELECT paused FROM target_control WHERE target_topic = 'ordres.retry'"},
		{name: "resume", action: "resume", form: url.Values{"target": {"audit.retry"}}, previewed: 1,
			check: "SELECT NOT paused FROM target_control WHERE target_topic = 'audit.retry'"},
		{name: "limit", action: "limit", form: url.Values{"target": {"orders.retry"}, "rate": {"2.5"}}, previewed: 1,
			check: "SELECT rate_limit = 2.5 FROM target_control WHERE target_topic = 'orders.retry'"},
		{name: "unlimit", action: "unlimit", form: url.Values{"target": {"bulk.retry"}}, previewed: 1,
			check: "SELECT rate_limit IS NULL FROM target_control WHERE target_topic = 'bulk.retry'"},
		{name: "weight", action: "weight", form: url.Values{"target": {"bulk.retry"}, "weight": {" 4 "}}, previewed: 1,
			check: "SELECT weight = 4 AND rate_limit = 25 FROM target_control WHERE target_topic = 'bulk.retry'"},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			db := dispatchtest.New(t)
			fixture.SeedOps(t, db.Pool)
			srv := serve(t, testConfig(t), db.Pool)
			c := login(t, srv, "alice")
			holds := func() bool {
				var ok *bool
				if err := db.Pool.QueryRow(ctx, st.check).Scan(&ok); err != nil && !strings.Contains(err.Error(), "no rows") {
					t.Fatalf("check: %v", err)
				}
				return ok != nil && *ok
			}
			if holds() {
				t.Fatalf("already true before the action: %s", st.check)
			}
			preview := c.act(st.action, st.form)
			mustHave(t, "preview", preview, 200, append([]string{"Nothing has changed yet", `data-action="` + st.action + `"`}, st.want...)...)
			if n := count(t, preview); n != st.previewed {
				t.Errorf("preview count %d, want %d", n, st.previewed)
			}
			if holds() {
				t.Fatalf("the preview changed it: %s", st.check)
			}
			r := confirm(t, c, st.action, preview, nil)
			mustHave(t, "result", r, 200, `id="result"`, fmt.Sprintf(`id="result-count">%d<`, st.previewed))
			if !holds() {
				t.Errorf("not done after the confirmation: %s", st.check)
			}
			if st.actor != 0 {
				if a := actorOf(t, db.Pool, st.actor); a != "console:alice" {
					t.Errorf("the history of %d names %q, want console:alice", st.actor, a)
				}
			}
		})
	}
}

// TestBadActions: every kind of bad action request is refused with a clear
// message and changes nothing.
func TestBadActions(t *testing.T) {
	db := dispatchtest.New(t)
	fixture.SeedOps(t, db.Pool)
	srv := serve(t, testConfig(t), db.Pool)
	alice := login(t, srv, "alice")
	victor := login(t, srv, "victor")
	cancel101 := url.Values{"ids": {"101"}, "confirm": {"1"}}

	tests := []struct {
		name string
		do   func() response
		code int
		want string
	}{
		{"viewer", func() response { return victor.act("cancel", cancel101) }, http.StatusForbidden, "viewers may look at everything but not act"},
		{"missing CSRF token", func() response { return alice.post("/actions/cancel", cancel101) }, http.StatusForbidden, "no CSRF token"},
		{"forged CSRF token", func() response {
			f := url.Values{"ids": {"101"}, "confirm": {"1"}, "csrf": {strings.Repeat("0", 64)}}
			return alice.post("/actions/cancel", f)
		}, http.StatusForbidden, "not this session"},
		{"another user's CSRF token", func() response {
			f := url.Values{"ids": {"101"}, "confirm": {"1"}, "csrf": {victor.csrf}}
			return alice.post("/actions/cancel", f)
		}, http.StatusForbidden, "not this session"},
		{"cross-site", func() response {
			f := url.Values{"ids": {"101"}, "confirm": {"1"}, "csrf": {alice.csrf}}
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL+"/actions/cancel", strings.NewReader(f.Encode()))
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Sec-Fetch-Site", "cross-site")
			return alice.do(req)
		}, http.StatusForbidden, "another site"},
		{"unknown action", func() response { return alice.act("frob", cancel101) }, http.StatusNotFound, "There is no action"},
		{"no ids", func() response { return alice.act("cancel", url.Values{"confirm": {"1"}}) }, http.StatusBadRequest, "ids"},
		{"bad ids", func() response { return alice.act("cancel", url.Values{"ids": {"101;DROP"}, "confirm": {"1"}}) }, http.StatusBadRequest, "positive integers"},
		{"park without why", func() response { return alice.act("park", url.Values{"ids": {"101"}, "confirm": {"1"}}) }, http.StatusBadRequest, "why"},
		{"bad rate", func() response {
			return alice.act("limit", url.Values{"target": {"orders.retry"}, "rate": {"fast"}, "confirm": {"1"}})
		}, http.StatusBadRequest, "rate"},
		{"bad weight", func() response {
			return alice.act("weight", url.Values{"target": {"orders.retry"}, "weight": {"101"}, "confirm": {"1"}})
		}, http.StatusBadRequest, "a whole number from 1 to 100"},
		{"weight not whole", func() response {
			return alice.act("weight", url.Values{"target": {"orders.retry"}, "weight": {"2.5"}, "confirm": {"1"}})
		}, http.StatusBadRequest, "weight"},
		{"bad scope", func() response { return alice.act("expedite", url.Values{"scope": {"all"}, "confirm": {"1"}}) }, http.StatusBadRequest, "scope"},
		{"bad due", func() response {
			return alice.act("fix", url.Values{"ids": {"106"}, "due": {"soon"}, "confirm": {"1"}})
		}, http.StatusBadRequest, "due"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mustHave(t, tt.name, tt.do(), tt.code, tt.want, `id="error"`)
			if n := db.Count("id IN (101, 106)"); n != 2 {
				t.Fatalf("messages changed: %d of 101, 106 left", n)
			}
			var paused bool
			_ = db.Pool.QueryRow(context.Background(), "SELECT coalesce(bool_or(rate_limit IS NOT NULL OR weight <> 1), false) FROM target_control WHERE target_topic = 'orders.retry'").Scan(&paused)
			if paused {
				t.Fatal("orders.retry was limited or weighted")
			}
		})
	}

	t.Run("viewer sees no action forms", func(t *testing.T) {
		for _, path := range []string{"/messages/101", "/keys?key=order-3", "/parked", "/rejected", "/targets", "/messages?state=parked"} {
			r := victor.get(path)
			if r.code != 200 || strings.Contains(r.body, "data-action=") || strings.Contains(r.body, `action="/actions/`) {
				t.Errorf("%s as a viewer: %d, has action forms: %v", path, r.code, strings.Contains(r.body, "data-action="))
			}
		}
		if r := alice.get("/messages/101"); !strings.Contains(r.body, `data-action="expedite"`) || !strings.Contains(r.body, `data-action="cancel"`) {
			t.Error("the operator sees no action forms on a pending message")
		}
	})
}
