package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/browsertest"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/pgtest"
)

// laterTopic is allowed by TARGET_TOPICS (orders.*) but absent from the
// broker until the test creates it: a message to it is parked by a refused
// publish (unknown_topic), as in production when a topic is not created yet.
const laterTopic = "orders.later"

// The console as a person uses it, in headless Chromium against `scheduler
// run` serving CONSOLE_ADDR: an operator logs in, follows the overview to
// a message the broker refused, reads it, creates the topic, previews and
// confirms a replay at a rate and sees the message delivered; pauses and
// resumes a target; a viewer sees no action and is refused when posting
// one anyway. The main pages are photographed on the way
// (UPDATE_SCREENSHOTS=1 writes them to docs/img/console for
// docs/console.md).
func TestConsoleInABrowser(t *testing.T) {
	// Both browsers start first: without Chromium the test fails at once,
	// saying how to install it.
	op := browsertest.New(t, browsertest.Options{})
	viewer := browsertest.New(t, browsertest.Options{})

	kc := kafkatest.StartCluster(t, kafkatest.Broker{Topics: []string{deferTopic, targetTopic}, Partitions: 4})
	brokers := kc.ListenAddrs()[0]
	db := pgtest.NewDB(t)
	opHash, viewerHash := hashPassword(t, "olga-secret"), hashPassword(t, "vic-secret")
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	p := start(t, append(serviceEnv(db.URL, brokers, "e2e-console"),
		"CONSOLE_ADDR="+addr,
		"CONSOLE_USERS=olga:operator:"+opHash+",vic:viewer:"+viewerHash,
		"CONSOLE_SESSION_KEY="+hex.EncodeToString(key)))
	base := "http://" + addr

	// What the consumers deferred: one message to a topic the broker does
	// not have yet, three of one key waiting an hour, one record with a
	// delay that is no duration, and one due at once.
	prod := producer(t, brokers)
	for _, m := range []struct {
		key, value, target, delay string
	}{
		{"order-7", `{"order":7,"total":"12.50","currency":"EUR"}`, laterTopic, "0s"},
		{"order-8", `{"order":8,"step":1}`, targetTopic, "1h"},
		{"order-8", `{"order":8,"step":2}`, targetTopic, "1h"},
		{"order-8", `{"order":8,"step":3}`, targetTopic, "1h"},
		{"order-9", `{"order":9}`, targetTopic, "soon"},
		{"order-10", `{"order":10}`, targetTopic, "0s"},
	} {
		rec := deferRecord(m.key, m.value, "defer.target", m.target, "defer.delay", m.delay,
			"defer.error.class", "ProviderTimeout", "content-type", "application/json")
		if _, _, err := prod.SendMessage(rec); err != nil {
			t.Fatal(err)
		}
	}
	waitRows(t, db.Pool, 20*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'parked' AND reason LIKE 'unknown_topic%'", 1)
	waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message", 5)

	// Log in; the overview is where a person starts.
	op.Open(base+"/", "form.login")
	op.Screenshot("login")
	login(op, "olga", "olga-secret")
	op.WaitVisible(`#targets tr[data-target="` + laterTopic + `"]`)
	if got := op.Text(`#targets tr[data-target="` + laterTopic + `"] [data-field="parked"]`); got != "1" {
		t.Errorf("the overview shows %q parked for %s, want 1", got, laterTopic)
	}
	if got := op.Text("#attention"); !strings.Contains(got, laterTopic) {
		t.Errorf("the overview's attention list does not name %s: %q", laterTopic, got)
	}
	op.Screenshot("overview")

	// Overview -> the parking lot of the target -> the reason's messages ->
	// the message.
	op.ClickLoad(`#targets tr[data-target="` + laterTopic + `"] [data-field="parked"] a`)
	op.WaitVisible(`#parked tr[data-target="` + laterTopic + `"]`)
	if got := op.Attr(`#parked tr[data-target="`+laterTopic+`"]`, "data-reason"); got != "unknown_topic" {
		t.Errorf("the parking lot gives reason %q for %s, want unknown_topic", got, laterTopic)
	}
	op.ClickLoad(`#parked tr[data-target="` + laterTopic + `"] a[href^="/messages"]`)
	op.WaitVisible("#messages tr[data-id]")
	if n := op.Count("#messages tr[data-id]"); n != 1 {
		t.Fatalf("the parked messages of %s: %d rows, want 1", laterTopic, n)
	}
	op.ClickLoad("#messages tr[data-id] a")
	op.WaitVisible("#payload")
	id, err := strconv.ParseInt(strings.TrimPrefix(mustURL(t, op.Location()).Path, "/messages/"), 10, 64)
	if err != nil {
		t.Fatalf("the message page's location %s names no id", op.Location())
	}
	if got := op.Text("#payload"); !strings.Contains(got, `"total"`) || !strings.Contains(got, "12.50") {
		t.Errorf("#payload = %q, want the record's value", got)
	}
	parkedRow := `#history tr.event-parked`
	if got := op.Text(parkedRow); !strings.Contains(got, "unknown_topic") {
		t.Errorf("the history's parked event reads %q, want its reason unknown_topic", got)
	}
	if got := op.Text("#headers"); !strings.Contains(got, "defer.target") || !strings.Contains(got, laterTopic) {
		t.Errorf("#headers lacks defer.target %s: %q", laterTopic, got)
	}
	op.Screenshot("message")

	// The other pages, for the documentation; each shows what was deferred.
	op.Open(base+"/messages", "#messages tr[data-id]")
	if n := op.Count("#messages tr[data-id]"); n != 5 {
		t.Errorf("/messages lists %d messages, want the 5 stored", n)
	}
	op.Screenshot("messages")
	op.Open(base+"/keys?key=order-8", "#key-messages tr[data-id]")
	if n := op.Count("#key-messages tr[data-id]"); n != 3 {
		t.Errorf("the key page of order-8 lists %d messages, want 3", n)
	}
	op.Screenshot("key")
	op.Open(base+"/rejected", "#rejected tr[data-id]")
	if got := op.Text("#rejected"); !strings.Contains(got, "invalid_delay") {
		t.Errorf("/rejected does not show the invalid_delay record: %q", got)
	}
	op.Screenshot("rejected")
	op.Open(base+"/parked", "#parked")
	op.Screenshot("parked")

	// The operator creates the topic, then replays the message at a rate:
	// the preview counts it and changes nothing, the confirmation moves it.
	createTopic(t, brokers, laterTopic, nil)
	out := read(t, brokers, laterTopic)
	op.Fill("form.filters[data-action=replay]", map[string]string{"ids": strconv.FormatInt(id, 10), "rate": "5"})
	op.ClickLoad("form.filters[data-action=replay] button[type=submit]")
	op.WaitVisible("#preview-count")
	if got := op.Text("#preview-count"); got != "1" {
		t.Fatalf("the replay's preview counts %q, want 1", got)
	}
	if got := op.Text("#preview-groups"); !strings.Contains(got, laterTopic) || !strings.Contains(got, "unknown_topic") {
		t.Errorf("the preview's groups do not show %s / unknown_topic: %q", laterTopic, got)
	}
	waitRows(t, db.Pool, time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'parked'", 1) // a preview changes nothing
	op.Screenshot("replay-preview")
	op.ClickLoad("button[name=confirm]")
	op.WaitVisible("#result")
	if got := op.Text("#result-count"); got != "1" {
		t.Errorf("the replay's result counts %q, want 1", got)
	}
	// The parking lot empties and the message is delivered, which its page
	// tells and the broker shows.
	op.Open(base+"/parked", "#parked")
	op.Poll("the message leaves the parking lot", `!document.querySelector('#parked tr[data-target="`+laterTopic+`"]')`, true, 10*time.Second)
	op.Open(base+"/messages/"+strconv.FormatInt(id, 10), "#history")
	op.Poll("the message page shows the delivery", `document.querySelector('#history tr.event-published')`, true, 20*time.Second)
	got := out.until(t, 10*time.Second, "the replayed message on "+laterTopic, atLeast(1))
	if len(got) != 1 || got[0].key != "order-7" || !strings.Contains(got[0].value, "12.50") {
		t.Errorf("%s holds %+v, want the one replayed record of order-7", laterTopic, got)
	}

	// Pause a target with a note, see it paused, resume it; the note stays.
	const note = "INC-42 downstream deploy"
	row := `#targets tr[data-target="` + targetTopic + `"]`
	op.Open(base+"/targets", row)
	op.Fill(row+` form[data-action=pause]`, map[string]string{"note": note})
	op.ClickLoad(row + ` form[data-action=pause] button[type=submit]`)
	op.WaitVisible("#preview-count")
	op.ClickLoad("button[name=confirm]")
	op.WaitVisible("#result")
	op.Open(base+"/targets", row)
	if got := op.Text(row); !strings.Contains(got, "paused") || !strings.Contains(got, note) {
		t.Errorf("the targets page shows %q for %s, want paused with the note", got, targetTopic)
	}
	op.Screenshot("targets")
	op.Open(base+"/", row)
	if got := op.Text(row + ` [data-field="control"]`); !strings.Contains(got, "paused") || !strings.Contains(got, note) {
		t.Errorf("the overview's control for %s reads %q, want paused: %s", targetTopic, got, note)
	}
	op.Open(base+"/targets", row)
	op.ClickLoad(row + ` form[data-action=resume] button[type=submit]`)
	op.WaitVisible("#preview-count")
	op.ClickLoad("button[name=confirm]")
	op.WaitVisible("#result")
	op.Open(base+"/targets", row)
	if got := op.Text(row); strings.Contains(got, "paused") || !strings.Contains(got, note) {
		t.Errorf("after resuming, the targets page shows %q for %s, want not paused, the note kept", got, targetTopic)
	}
	// Give the target a weight: the page shows it, the claims read it.
	if got := op.Text(row + ` [data-field="weight"]`); got != "1" {
		t.Errorf("the targets page shows weight %q for %s, want the default 1", got, targetTopic)
	}
	op.Fill(row+` form[data-action=weight]`, map[string]string{"weight": "3"})
	op.ClickLoad(row + ` form[data-action=weight] button[type=submit]`)
	op.WaitVisible("#preview-count")
	op.ClickLoad("button[name=confirm]")
	op.WaitVisible("#result")
	op.Open(base+"/targets", row)
	if got := op.Text(row + ` [data-field="weight"]`); got != "3" {
		t.Errorf("after weighting, the targets page shows weight %q for %s, want 3", got, targetTopic)
	}
	op.Open(base+"/", row)
	if got := op.Text(row + ` [data-field="control"]`); !strings.Contains(got, "weight 3") {
		t.Errorf("the overview's control for %s reads %q, want weight 3", targetTopic, got)
	}
	var weight int
	if err := db.Pool.QueryRow(context.Background(), "SELECT weight FROM target_control WHERE target_topic = $1", targetTopic).Scan(&weight); err != nil || weight != 3 {
		t.Errorf("target_control.weight of %s is %d (%v), want 3", targetTopic, weight, err)
	}
	var actors string
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT string_agg(DISTINCT actor, ',') FROM target_control_history WHERE target_topic = $1", targetTopic).Scan(&actors); err != nil {
		t.Fatal(err)
	}
	if actors != "console:olga" {
		t.Errorf("target_control_history names %q as who paused, resumed and weighted, want console:olga", actors)
	}

	// A viewer sees every page and no action, and is refused an action
	// posted by hand with a valid CSRF token; the rows stay as they were.
	var pendingID int64
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT min(id) FROM deferred_message WHERE business_key = 'order-8'").Scan(&pendingID); err != nil {
		t.Fatal(err)
	}
	viewer.Open(base+"/", "form.login")
	login(viewer, "vic", "vic-secret")
	viewer.WaitVisible("#targets")
	for _, path := range []string{"/", "/messages", "/messages/" + strconv.FormatInt(pendingID, 10), "/keys?key=order-8",
		"/parked", "/rejected", "/targets"} {
		viewer.Open(base+path, "main")
		if n := viewer.Count("form[data-action]"); n != 0 {
			t.Errorf("the viewer sees %d action form(s) on %s, want none", n, path)
		}
	}
	csrf := viewer.Attr(`form[action="/logout"] input[name=csrf]`, "value")
	for _, a := range []struct {
		action string
		form   url.Values
	}{
		{"pause", url.Values{"target": {targetTopic}, "note": {"viewer was here"}, "confirm": {"1"}}},
		{"cancel", url.Values{"ids": {strconv.FormatInt(pendingID, 10)}, "confirm": {"1"}}},
	} {
		a.form.Set("csrf", csrf)
		var res struct {
			Status int    `json:"status"`
			Body   string `json:"body"`
		}
		viewer.Eval(`fetch("/actions/`+a.action+`", {method: "POST", headers: {"Content-Type": "application/x-www-form-urlencoded"},
			body: `+jsString(a.form.Encode())+`}).then(async r => ({status: r.status, body: await r.text()}))`, &res)
		if res.Status != 403 || !strings.Contains(res.Body, "viewer") {
			t.Errorf("a viewer's %s answered %d, want 403 saying viewers may not act:\n%.500s", a.action, res.Status, res.Body)
		}
	}
	var paused bool
	var messages int
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT coalesce((SELECT paused FROM target_control WHERE target_topic = $1), false), (SELECT count(*) FROM deferred_message WHERE id = $2)",
		targetTopic, pendingID).Scan(&paused, &messages); err != nil {
		t.Fatal(err)
	}
	if paused || messages != 1 {
		t.Errorf("after the viewer's posts: %s paused %v, message %d present %d times; want unchanged (not paused, present)", targetTopic, paused, pendingID, messages)
	}
	// No script failed and the Content-Security-Policy refused nothing the
	// pages need. (The viewer's refused posts above log their 403s.)
	for _, b := range []*browsertest.Browser{op, viewer} {
		for _, m := range b.Console() {
			if strings.HasPrefix(m, "exception") || strings.Contains(m, "Content Security Policy") || strings.Contains(m, "Refused to") {
				t.Errorf("the page wrote to the browser's console: %s", m)
			}
			t.Logf("browser console: %s", m)
		}
	}
	p.stop()
}

// login fills and submits the login form on the page b shows.
func login(b *browsertest.Browser, user, password string) {
	b.Fill("form.login", map[string]string{"user": user, "password": password})
	b.ClickLoad("form.login button[type=submit]")
}

// hashPassword makes a CONSOLE_USERS hash as a person does, with
// `scheduler console hash-password` reading the password on stdin.
func hashPassword(t *testing.T, password string) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), binary(t), "console", "hash-password")
	cmd.Stdin = strings.NewReader(password + "\n")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("scheduler console hash-password: %v\n%s", err, stderr.String())
	}
	return strings.TrimSpace(stdout.String())
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	if err != nil {
		t.Fatalf("parse URL %q: %v", s, err)
	}
	return u
}

// jsString makes s a JavaScript string literal.
func jsString(s string) string {
	b, _ := json.Marshal(s) // a string always marshals
	return string(b)
}
