package console

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/operate"
)

// overviewWindow is how far back the overview counts deliveries.
const overviewWindow = "5 minutes"

// heldShown is how many held keys the overview lists.
const heldShown = 20

// overviewRow is a row of console_overview.sql.
type overviewRow struct {
	TargetTopic     *string    `db:"target_topic" json:"target_topic"`
	Pending         int64      `db:"pending" json:"pending"`
	Due             int64      `db:"due" json:"due"`
	DueHeads        int64      `db:"due_heads" json:"due_heads"`
	OldestDue       *time.Time `db:"oldest_due" json:"oldest_due"`
	LatenessSeconds float64    `db:"lateness_seconds" json:"lateness_seconds"`
	Parked          int64      `db:"parked" json:"parked"`
	Rejected        int64      `db:"rejected" json:"rejected"`
	Paused          bool       `db:"paused" json:"paused"`
	Note            *string    `db:"note" json:"note"`
	RateLimit       *float64   `db:"rate_limit" json:"rate_limit"`
	Published       int64      `db:"published" json:"published"`
	// Estimated: Pending and Due are scaled up from a sample of the table
	// (console_overview.sql says when).
	Estimated bool `db:"estimated" json:"estimated"`
	// Weight is the target's heads per turn of a claim (1: the default).
	Weight int `db:"weight" json:"weight"`
}

// Late reports whether the target's oldest due head waited more than a
// minute; a paused target's heads wait on purpose.
func (o overviewRow) Late() bool { return !o.Paused && o.LatenessSeconds > 60 }

// overviewData is the overview, as the page and /api/overview show it.
type overviewData struct {
	At        time.Time            `json:"at"`
	Window    string               `json:"published_window"`
	Targets   []overviewRow        `json:"targets"`
	Held      []operate.HeldKeyRow `json:"held_keys"`
	HeldTotal int                  `json:"held_keys_total"`
	Attention []attention          `json:"attention"`
	// Every is how often the counts are refreshed at most.
	Every string `json:"refreshed_every"`
	// Ingest is how far ingest has stored each partition of the defer
	// topic, and how far behind it is when Kafka could be asked.
	Ingest []ingestRow `json:"ingest"`
	// IngestNote says why the lag is unknown, when it is.
	IngestNote string `json:"ingest_note,omitempty"`
}

// ingestRow is a row of ingest_progress.sql, with the partition's
// high-water mark and the lag when Kafka answered.
type ingestRow struct {
	Partition   int32     `db:"partition" json:"partition"`
	NextOffset  int64     `db:"next_offset" json:"next_offset"`
	UpdatedAt   time.Time `db:"updated_at" json:"updated_at"`
	IdleSeconds float64   `db:"idle_seconds" json:"idle_seconds"`
	Epoch       int32     `db:"epoch" json:"epoch"`
	HighWater   *int64    `db:"-" json:"high_water"`
	Lag         *int64    `db:"-" json:"lag"`
}

// ingestStuckAfter is how long a partition with records to ingest may keep
// its position before the overview calls it stuck.
const ingestStuckAfter = time.Minute

// highWaterWait bounds asking Kafka for the overview: a broker that does
// not answer must not hold the page.
const highWaterWait = 3 * time.Second

// readHighWater asks s.cfg.HighWaterMarks, within highWaterWait.
func (s *server) readHighWater() (map[int32]int64, error) {
	if s.cfg.HighWaterMarks == nil {
		return nil, errors.New("this console has no connection to Kafka")
	}
	type answer struct {
		marks map[int32]int64
		err   error
	}
	ch := make(chan answer, 1)
	go func() {
		m, err := s.cfg.HighWaterMarks()
		ch <- answer{m, err}
	}()
	select {
	case a := <-ch:
		return a.marks, a.err
	case <-time.After(highWaterWait):
		return nil, fmt.Errorf("the brokers did not answer within %s", highWaterWait)
	}
}

// addLag fills in each partition's high-water mark and lag, or says why it
// cannot.
func (s *server) addLag(d *overviewData) {
	marks, err := s.readHighWater()
	if err != nil {
		d.IngestNote = "How far ingest is behind is unknown: " + err.Error() + "."
		return
	}
	seen := map[int32]bool{}
	for i := range d.Ingest {
		r := &d.Ingest[i]
		seen[r.Partition] = true
		if hw, ok := marks[r.Partition]; ok {
			lag := max(hw-r.NextOffset, 0)
			r.HighWater, r.Lag = &hw, &lag
		}
	}
	// A partition ingest has never stored from: all of it waits.
	for p, hw := range marks {
		if !seen[p] && hw > 0 {
			lag := hw
			d.Ingest = append(d.Ingest, ingestRow{Partition: p, HighWater: &hw, Lag: &lag, IdleSeconds: -1})
		}
	}
	slices.SortFunc(d.Ingest, func(a, b ingestRow) int { return cmp.Compare(a.Partition, b.Partition) })
}

// attention is one thing that needs a look, with a link to it.
type attention struct {
	Text string `json:"text"`
	Link string `json:"link"`
}

// getOverview returns the overview, counted at most every OverviewEvery
// whoever asks, so that many people watching cost the database no more
// than one.
func (s *server) getOverview(ctx context.Context) (*overviewData, error) {
	s.overviewMu.Lock()
	defer s.overviewMu.Unlock()
	if s.overview != nil && time.Since(s.overview.At) < s.cfg.OverviewEvery {
		return s.overview, nil
	}
	d := &overviewData{Window: overviewWindow, Every: s.cfg.OverviewEvery.String()}
	err := s.readTx(ctx, func(tx pgx.Tx) error {
		var err error
		if d.Targets, err = operate.Rows[overviewRow](ctx, tx, "console_overview.sql", map[string]string{"window": overviewWindow}); err != nil {
			return err
		}
		if d.Held, err = operate.Rows[operate.HeldKeyRow](ctx, tx, "held_keys.sql", map[string]string{"limit": strconv.Itoa(heldShown)}); err != nil {
			return err
		}
		if len(d.Held) > 0 {
			d.HeldTotal = int(d.Held[0].HeldTotal)
		}
		if d.Ingest, err = operate.Rows[ingestRow](ctx, tx, "ingest_progress.sql", map[string]string{"topic": s.cfg.DeferTopic}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT now()").Scan(&d.At)
	})
	if err != nil {
		return nil, err
	}
	s.addLag(d)
	d.At = time.Now()
	d.Attention = needsAttention(d)
	s.overview = d
	return d, nil
}

// needsAttention lists what to look at first: lateness, held keys, the
// parking lot, rejections, pauses.
func needsAttention(d *overviewData) []attention {
	out := []attention{}
	targets := slices.Clone(d.Targets)
	slices.SortStableFunc(targets, func(a, b overviewRow) int { return cmp.Compare(b.LatenessSeconds, a.LatenessSeconds) })
	for _, t := range targets {
		if t.Late() {
			out = append(out, attention{fmt.Sprintf("%s is late: its oldest due message waits for %s (%d due heads)",
				orDash(t.TargetTopic), humanSeconds(t.LatenessSeconds), t.DueHeads),
				"/messages?state=pending&sort=due&target=" + url.QueryEscape(globQuote(deref(t.TargetTopic)))})
		}
	}
	for _, r := range d.Ingest {
		if r.Lag == nil || *r.Lag == 0 {
			continue
		}
		if r.IdleSeconds < 0 {
			out = append(out, attention{fmt.Sprintf("ingest has stored nothing of partition %d: %d record(s) wait", r.Partition, *r.Lag), "#ingest"})
		} else if r.IdleSeconds > ingestStuckAfter.Seconds() {
			out = append(out, attention{fmt.Sprintf("ingest is not moving on partition %d: %d record(s) wait, position unchanged for %s",
				r.Partition, *r.Lag, humanSeconds(r.IdleSeconds)), "#ingest"})
		}
	}
	parkedHeld := 0
	for _, h := range d.Held {
		if h.Kind == operate.HeldParked {
			parkedHeld++
		}
	}
	if parkedHeld > 0 {
		// Parked heads come first: when all the keys shown are parked and
		// more are held, there may be more parked ones.
		count := strconv.Itoa(parkedHeld)
		if parkedHeld == len(d.Held) && d.HeldTotal > len(d.Held) {
			count = "at least " + count
		}
		out = append(out, attention{count + " business key(s) held by a parked message: what follows them waits", "/parked"})
	}
	for _, t := range d.Targets {
		if t.Parked > 0 {
			out = append(out, attention{fmt.Sprintf("%s has %d parked message(s)", orDash(t.TargetTopic), t.Parked),
				"/parked?target=" + url.QueryEscape(deref(t.TargetTopic))})
		}
	}
	var rejected int64
	for _, t := range d.Targets {
		rejected += t.Rejected
	}
	if rejected > 0 {
		out = append(out, attention{fmt.Sprintf("%d rejected record(s) to fix or cancel", rejected), "/rejected"})
	}
	for _, t := range d.Targets {
		if t.Paused {
			out = append(out, attention{fmt.Sprintf("%s is paused (%s)", orDash(t.TargetTopic), cmp.Or(deref(t.Note), "no note")), "/targets"})
		}
	}
	return out
}

func (s *server) overviewPage(w http.ResponseWriter, r *http.Request, u *session) {
	d, err := s.getOverview(r.Context())
	if err != nil {
		s.dbFail(w, r, u, "read the overview", err)
		return
	}
	s.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", User: u, Data: d})
}

func (s *server) overviewJSON(w http.ResponseWriter, r *http.Request, u *session) {
	d, err := s.getOverview(r.Context())
	if err != nil {
		s.logger.Error("console: overview", "error", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, d)
}

// badInput is a request parameter that is not acceptable.
type badInput struct {
	Field, Value, Want string
}

func (b *badInput) Error() string {
	return fmt.Sprintf("%s %q is not valid: want %s", b.Field, b.Value, b.Want)
}

func (s *server) badRequest(w http.ResponseWriter, r *http.Request, u *session, b *badInput) {
	s.fail(w, r, u, http.StatusBadRequest, "Bad input: "+b.Error()+". Nothing was changed.")
}

// listRow is a row of console_messages.sql and key_messages.sql.
type listRow struct {
	ID           int64     `db:"id"`
	BusinessKey  *string   `db:"business_key"`
	Seq          int64     `db:"seq"`
	TargetTopic  *string   `db:"target_topic"`
	State        string    `db:"state"`
	NextRunAt    time.Time `db:"next_run_at"`
	Attempt      int32     `db:"attempt"`
	Reason       *string   `db:"reason"`
	ErrorClass   *string   `db:"error_class"`
	CreatedAt    time.Time `db:"created_at"`
	RedriveCount int32     `db:"redrive_count"`
	IsHead       bool      `db:"is_head"`
}

// keyRow is a row of key_messages.sql.
type keyRow struct {
	listRow
	HoldsKey bool `db:"holds_key"`
}

// msgFilter is the messages page's filters, as in the URL.
type msgFilter struct {
	State, Target, Key, Reason, ErrorClass, Since, Until, Sort, Cursor string
	Limit                                                              int
	// what the runbook file gets
	vars map[string]string
}

var sorts = []string{"due", "oldest", "newest"}

// parseMsgFilter checks the messages page's parameters.
func parseMsgFilter(q url.Values, now time.Time) (msgFilter, *badInput) {
	f := msgFilter{State: q.Get("state"), Target: q.Get("target"), Key: q.Get("key"), Reason: q.Get("reason"),
		ErrorClass: q.Get("error_class"), Since: q.Get("since"), Until: q.Get("until"),
		Sort: cmp.Or(q.Get("sort"), "oldest"), Cursor: q.Get("cursor"), Limit: 50}
	v := map[string]string{"state": f.State, "reason": f.Reason, "target": "", "error_class": "",
		"since": "", "until": "", "sort": f.Sort, "after_at": "", "after_id": ""}
	switch f.State {
	case "", "pending", "parked", "rejected":
	default:
		return f, &badInput{"state", f.State, "pending, parked, rejected or empty (any)"}
	}
	if !slices.Contains(sorts, f.Sort) {
		return f, &badInput{"sort", f.Sort, "due (due time), oldest or newest (stored)"}
	}
	var err error
	if f.Target != "" {
		if v["target"], err = operate.GlobToLike(f.Target); err != nil {
			return f, &badInput{"target", f.Target, "a glob: * any run of characters, ? one, \\ quotes (" + err.Error() + ")"}
		}
	}
	if f.ErrorClass != "" {
		if v["error_class"], err = operate.GlobToLike(f.ErrorClass); err != nil {
			return f, &badInput{"error_class", f.ErrorClass, "a glob: * any run of characters, ? one, \\ quotes (" + err.Error() + ")"}
		}
	}
	if strings.Contains(f.Reason, ":") {
		return f, &badInput{"reason", f.Reason, "a reason code, the part of the reason before the colon (e.g. unknown_topic)"}
	}
	for _, w := range []struct{ name, value string }{{"since", f.Since}, {"until", f.Until}} {
		if w.value == "" {
			continue
		}
		t, err := parseWhen(w.value, now)
		if err != nil {
			return f, &badInput{w.name, w.value, "an RFC 3339 time (2024-05-01T12:00:00Z), a date and time (2024-05-01T12:00, UTC) or a duration meaning that long ago (90m, 48h)"}
		}
		v[w.name] = t.UTC().Format(time.RFC3339Nano)
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 500 {
			return f, &badInput{"limit", l, "an integer 1..500"}
		}
		f.Limit = n
	}
	if f.Cursor != "" && f.Key != "" {
		seq, id, ok := strings.Cut(f.Cursor, "_")
		_, e1 := strconv.ParseInt(seq, 10, 64)
		_, e2 := strconv.ParseInt(id, 10, 64)
		if !ok || e1 != nil || e2 != nil {
			return f, &badInput{"cursor", f.Cursor, "seq_id (from the next-page link)"}
		}
		v["after_seq"], v["after_id"] = seq, id
	} else if f.Cursor != "" {
		at, id, bad := parseCursor(f.Cursor, f.Sort == "due")
		if bad {
			want := "a message id (from the next-page link)"
			if f.Sort == "due" {
				want = "due-time_id (from the next-page link)"
			}
			return f, &badInput{"cursor", f.Cursor, want}
		}
		v["after_at"], v["after_id"] = at, id
	}
	v["limit"] = strconv.Itoa(f.Limit + 1)
	f.vars = v
	return f, nil
}

// parseCursor reads a next-page cursor: an id, or with a time, time_id.
func parseCursor(c string, withTime bool) (at, id string, bad bool) {
	idPart := c
	if withTime {
		t, rest, ok := strings.Cut(c, "_")
		if !ok {
			return "", "", true
		}
		if _, err := time.Parse(time.RFC3339Nano, t); err != nil {
			return "", "", true
		}
		at, idPart = t, rest
	}
	if _, err := strconv.ParseInt(idPart, 10, 64); err != nil {
		return "", "", true
	}
	return at, idPart, false
}

// parseWhen reads a point in time: RFC 3339, an HTML datetime-local value
// (UTC), or a duration meaning that long before now.
func parseWhen(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range []string{"2006-01-02T15:04", "2006-01-02T15:04:05", "2006-01-02 15:04", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return time.Time{}, errors.New("not a time")
	}
	return now.Add(-d), nil
}

// globQuote quotes a topic name so that it reads as itself in a glob.
func globQuote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `*`, `\*`, `?`, `\?`, `[`, `\[`)
	return r.Replace(s)
}

// messagesData is the messages page.
type messagesData struct {
	Filter msgFilter
	Rows   []listRow
	// Next is the next page's URL; empty on the last page.
	Next string
}

func (s *server) messagesPage(w http.ResponseWriter, r *http.Request, u *session) {
	f, bad := parseMsgFilter(r.URL.Query(), time.Now())
	if bad != nil {
		s.badRequest(w, r, u, bad)
		return
	}
	d := messagesData{Filter: f}
	if f.Key != "" {
		s.keyMessages(w, r, u, d)
		return
	}
	err := s.readTx(r.Context(), func(tx pgx.Tx) error {
		var err error
		d.Rows, err = operate.Rows[listRow](r.Context(), tx, "console_messages.sql", f.vars)
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "list messages", err)
		return
	}
	if len(d.Rows) > f.Limit {
		d.Rows = d.Rows[:f.Limit]
		last := d.Rows[len(d.Rows)-1]
		q := r.URL.Query()
		cursor := strconv.FormatInt(last.ID, 10)
		if f.Sort == "due" {
			cursor = last.NextRunAt.UTC().Format(time.RFC3339Nano) + "_" + cursor
		}
		q.Set("cursor", cursor)
		d.Next = "/messages?" + q.Encode()
	}
	s.render(w, r, http.StatusOK, "messages", page{Title: "Messages", Nav: "messages", User: u, Data: d})
}

// keyScan is how many messages of one key a messages page reads to
// filter.
const keyScan = 500

// keyMessages is the messages page filtered by business key: no index holds
// every row's key, so it reads the key's messages in seq order
// (key_messages.sql, through the indexes of each state) and applies the
// other filters here.
func (s *server) keyMessages(w http.ResponseWriter, r *http.Request, u *session, d messagesData) {
	f := d.Filter
	var rows []keyRow
	err := s.readTx(r.Context(), func(tx pgx.Tx) error {
		var err error
		rows, err = operate.Rows[keyRow](r.Context(), tx, "key_messages.sql", map[string]string{"key": f.Key,
			"after_seq": f.vars["after_seq"], "after_id": f.vars["after_id"], "limit": strconv.Itoa(keyScan)})
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "list messages", err)
		return
	}
	target, errorClass := globRegexp(f.Target), globRegexp(f.ErrorClass)
	var since, until time.Time
	if f.vars["since"] != "" {
		since, _ = time.Parse(time.RFC3339Nano, f.vars["since"])
	}
	if f.vars["until"] != "" {
		until, _ = time.Parse(time.RFC3339Nano, f.vars["until"])
	}
	var last *keyRow
	for i := range rows {
		m := rows[i]
		if len(d.Rows) == f.Limit {
			break
		}
		last = &rows[i]
		switch {
		case f.State != "" && m.State != f.State,
			target != nil && !target.MatchString(deref(m.TargetTopic)),
			errorClass != nil && !errorClass.MatchString(deref(m.ErrorClass)),
			f.Reason != "" && reasonCode(m.Reason) != f.Reason,
			!since.IsZero() && m.CreatedAt.Before(since),
			!until.IsZero() && !m.CreatedAt.Before(until):
			continue
		}
		d.Rows = append(d.Rows, m.listRow)
	}
	if last != nil && (len(rows) == keyScan || last != &rows[len(rows)-1]) {
		q := r.URL.Query()
		q.Set("cursor", fmt.Sprintf("%d_%d", last.Seq, last.ID))
		d.Next = "/messages?" + q.Encode()
	}
	s.render(w, r, http.StatusOK, "messages", page{Title: "Messages", Nav: "messages", User: u, Data: d})
}

// globRegexp compiles a glob the way globToLike reads it; nil for "".
func globRegexp(glob string) *regexp.Regexp {
	if glob == "" {
		return nil
	}
	var b strings.Builder
	b.WriteString("^")
	quoted := false
	for _, c := range glob {
		switch {
		case quoted:
			b.WriteString(regexp.QuoteMeta(string(c)))
			quoted = false
		case c == '*':
			b.WriteString("(?s:.*)")
		case c == '?':
			b.WriteString("(?s:.)")
		case c == '\\':
			quoted = true
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString("$")
	return regexp.MustCompile(b.String())
}

// payloadCap is how much of a value the message page shows.
const payloadCap = 64 << 10

// messageData is the message page.
type messageData struct {
	ID      int64
	Gone    bool
	Row     *operate.MessageRow
	Headers []operate.HeaderRow
	Lineage []operate.LineageRow
	History []operate.HistoryRow
	// Payload is the value as shown; Kind says how: json, text, hex or none.
	Payload, PayloadKind string
	PayloadCut           bool
	Key                  []keyRow
	KeyMore              bool
}

func (s *server) messagePage(w http.ResponseWriter, r *http.Request, u *session) {
	raw := r.PathValue("id")
	id, err := strconv.ParseInt(raw, 10, 64)
	if err != nil || id <= 0 {
		s.badRequest(w, r, u, &badInput{"message id", raw, "a positive integer, e.g. /messages/1234"})
		return
	}
	d := messageData{ID: id}
	ctx := r.Context()
	err = s.readTx(ctx, func(tx pgx.Tx) error {
		sts, err := operate.Statements("show_message.sql", map[string]string{"id": raw})
		if err != nil {
			return err
		}
		if len(sts) != 4 {
			return fmt.Errorf("runbook show_message.sql: %d statements, want 4", len(sts))
		}
		rows, err := operate.Collect[operate.MessageRow](ctx, tx, sts[0])
		if err != nil {
			return operate.ExplainDBError("show_message.sql", err)
		}
		if len(rows) == 1 {
			d.Row = &rows[0]
		}
		if d.Headers, err = operate.Collect[operate.HeaderRow](ctx, tx, sts[1]); err != nil {
			return operate.ExplainDBError("show_message.sql", err)
		}
		if d.Lineage, err = operate.Collect[operate.LineageRow](ctx, tx, sts[2]); err != nil {
			return operate.ExplainDBError("show_message.sql", err)
		}
		if d.History, err = operate.Collect[operate.HistoryRow](ctx, tx, sts[3]); err != nil {
			return operate.ExplainDBError("show_message.sql", err)
		}
		if d.Row != nil && d.Row.BusinessKey != nil {
			krows, err := operate.Rows[keyRow](ctx, tx, "key_messages.sql", map[string]string{
				"key": *d.Row.BusinessKey, "after_seq": "", "after_id": "", "limit": "21"})
			if err != nil {
				return err
			}
			d.KeyMore = len(krows) > 20
			d.Key = krows[:min(len(krows), 20)]
		}
		return nil
	})
	if err != nil {
		s.dbFail(w, r, u, fmt.Sprintf("read message %d", id), err)
		return
	}
	if d.Row == nil && len(d.History) == 0 {
		s.fail(w, r, u, http.StatusNotFound, fmt.Sprintf("There is no message %d: it never existed, or it is gone and its history was pruned (HISTORY_RETENTION).", id))
		return
	}
	d.Gone = d.Row == nil
	if d.Row != nil {
		d.Payload, d.PayloadKind, d.PayloadCut = preview(d.Row.ValueEncoding, d.Row.Value)
	}
	s.render(w, r, http.StatusOK, "message", page{Title: fmt.Sprintf("Message %d", id), Nav: "messages", User: u, Data: d})
}

// preview turns a value as show_message.sql prints it (text, or \x and
// hex) into what the page shows: pretty JSON when it parses, else text or
// hex, at most payloadCap bytes.
func preview(encoding, value *string) (text, kind string, cut bool) {
	if encoding == nil || value == nil {
		return "", "none", false
	}
	v := *value
	if *encoding == "hex" {
		if len(v) > payloadCap*2 {
			return v[:payloadCap*2], "hex", true
		}
		return v, "hex", false
	}
	if json.Valid([]byte(v)) {
		var b strings.Builder
		enc := json.NewEncoder(&b)
		enc.SetIndent("", "  ")
		enc.SetEscapeHTML(false)
		var anyv any
		if json.Unmarshal([]byte(v), &anyv) == nil && enc.Encode(anyv) == nil && len(v) <= payloadCap {
			return strings.TrimSuffix(b.String(), "\n"), "json", false
		}
	}
	if len(v) > payloadCap {
		cutAt := payloadCap
		for cutAt > 0 && !utf8Start(v[cutAt]) {
			cutAt--
		}
		return printable(v[:cutAt]), "text", true
	}
	return printable(v), "text", false
}

func utf8Start(b byte) bool { return b&0xC0 != 0x80 }

// keyStateRow is the row of key_state.sql.
type keyStateRow struct {
	BusinessKey     string     `db:"business_key"`
	HeadID          int64      `db:"head_id"`
	Held            bool       `db:"held"`
	Failures        int32      `db:"failures"`
	LeasedUntil     *time.Time `db:"leased_until"`
	Leased          bool       `db:"leased"`
	LeasedBy        *string    `db:"leased_by"`
	NextRunAt       *time.Time `db:"next_run_at"`
	Throttled       bool       `db:"throttled"`
	HeadTarget      *string    `db:"head_target"`
	TargetPaused    bool       `db:"target_paused"`
	TargetRateLimit *float64   `db:"target_rate_limit"`
	TargetNote      *string    `db:"target_note"`
}

// keyData is the key page.
type keyData struct {
	Key      string
	State    *keyStateRow
	Inflight []operate.InflightRow
	// Why says, in order of weight, what keeps the key from moving.
	Why  []string
	Rows []keyRow
	Next string
	// HeadParked: the head is a parked message holding the key.
	HeadParked bool
}

func (s *server) keyPage(w http.ResponseWriter, r *http.Request, u *session) {
	q := r.URL.Query()
	if !q.Has("key") || q.Get("key") == "" {
		s.badRequest(w, r, u, &badInput{"key", "", "a business key, exact (any characters), e.g. /keys?key=order-42"})
		return
	}
	d := keyData{Key: q.Get("key")}
	afterSeq, afterID := "", ""
	if c := q.Get("cursor"); c != "" {
		a, b, ok := strings.Cut(c, "_")
		_, e1 := strconv.ParseInt(a, 10, 64)
		_, e2 := strconv.ParseInt(b, 10, 64)
		if !ok || e1 != nil || e2 != nil {
			s.badRequest(w, r, u, &badInput{"cursor", c, "seq_id (from the next-page link)"})
			return
		}
		afterSeq, afterID = a, b
	}
	const limit = 50
	ctx := r.Context()
	err := s.readTx(ctx, func(tx pgx.Tx) error {
		st, err := operate.Rows[keyStateRow](ctx, tx, "key_state.sql", map[string]string{"key": d.Key})
		if err != nil {
			return err
		}
		if len(st) == 1 {
			d.State = &st[0]
		}
		if d.Inflight, err = operate.Rows[operate.InflightRow](ctx, tx, "inflight.sql", map[string]string{"group": "", "key": d.Key, "limit": "100"}); err != nil {
			return err
		}
		d.Rows, err = operate.Rows[keyRow](ctx, tx, "key_messages.sql", map[string]string{
			"key": d.Key, "after_seq": afterSeq, "after_id": afterID, "limit": strconv.Itoa(limit + 1)})
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "read key", err)
		return
	}
	if len(d.Rows) > limit {
		d.Rows = d.Rows[:limit]
		last := d.Rows[limit-1]
		q.Set("cursor", fmt.Sprintf("%d_%d", last.Seq, last.ID))
		d.Next = "/keys?" + q.Encode()
	}
	d.Why = whyBlocked(d.State, d.Inflight, time.Now())
	d.HeadParked = d.State != nil && d.State.Held
	s.render(w, r, http.StatusOK, "key", page{Title: "Key " + printable(d.Key), Nav: "messages", User: u, Data: d})
}

// whyBlocked explains a key's state in words.
func whyBlocked(k *keyStateRow, inflight []operate.InflightRow, now time.Time) []string {
	if k == nil {
		if len(inflight) > 0 {
			return []string{"Nothing of this key waits here, but it is in flight: a consumer group has not committed past its last republished record."}
		}
		return []string{"Nothing of this key waits: no pending message, and no parked message holds it."}
	}
	var why []string
	if k.Held {
		why = append(why, fmt.Sprintf("Held by parked message %d: nothing of the key moves until it is replayed or cancelled.", k.HeadID))
	}
	if k.Failures > 0 {
		why = append(why, fmt.Sprintf("Backing off after %d failed publish(es) of its head.", k.Failures))
	}
	if deref(k.LeasedBy) == "in-flight" {
		groups := []string{}
		for _, i := range inflight {
			if !slices.Contains(groups, i.GroupID) {
				groups = append(groups, i.GroupID)
			}
		}
		why = append(why, "In flight: waiting for consumer group(s) "+strings.Join(groups, ", ")+" to commit past the republished record.")
	} else if k.Leased {
		why = append(why, fmt.Sprintf("Leased by %s until %s: a dispatcher is publishing its head.", orDash(k.LeasedBy), formatTimePtr(k.LeasedUntil)))
	}
	if k.TargetPaused {
		why = append(why, fmt.Sprintf("Its target %s is paused (%s).", orDash(k.HeadTarget), cmp.Or(deref(k.TargetNote), "no note")))
	}
	if k.TargetRateLimit != nil {
		why = append(why, fmt.Sprintf("Its target %s is limited to %s messages/s.", orDash(k.HeadTarget), formatRate(k.TargetRateLimit)))
	}
	if len(why) == 0 && k.NextRunAt != nil {
		if k.NextRunAt.After(now) {
			why = append(why, fmt.Sprintf("Not blocked: its head %d is due %s (%s).", k.HeadID, formatTime(*k.NextRunAt), ago(*k.NextRunAt)))
		} else {
			why = append(why, fmt.Sprintf("Not blocked: its head %d is due (since %s) and goes out at the next dispatch round.", k.HeadID, formatTime(*k.NextRunAt)))
		}
	}
	return why
}

// parkedSummaryRow is a row of parked_summary.sql.
type parkedSummaryRow struct {
	TargetTopic *string   `db:"target_topic"`
	Reason      string    `db:"reason"`
	Messages    int64     `db:"messages"`
	HoldingKeys int64     `db:"holding_keys"`
	DLQUnsent   int64     `db:"dlq_unsent"`
	Oldest      time.Time `db:"oldest"`
	Newest      time.Time `db:"newest"`
	MaxRedrives int32     `db:"max_redrives"`
}

type parkedData struct {
	Target string
	Rows   []parkedSummaryRow
}

func (s *server) parkedPage(w http.ResponseWriter, r *http.Request, u *session) {
	d := parkedData{Target: r.URL.Query().Get("target")}
	err := s.readTx(r.Context(), func(tx pgx.Tx) error {
		var err error
		d.Rows, err = operate.Rows[parkedSummaryRow](r.Context(), tx, "parked_summary.sql", nil)
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "read the parking lot", err)
		return
	}
	if d.Target != "" {
		d.Rows = slices.DeleteFunc(d.Rows, func(p parkedSummaryRow) bool { return deref(p.TargetTopic) != d.Target })
	}
	s.render(w, r, http.StatusOK, "parked", page{Title: "Parking lot", Nav: "parked", User: u, Data: d})
}

type rejectedData struct {
	Window  string
	Reasons []operate.RejectedRow
	Reason  string
	Rows    []listRow
	Next    string
}

var rejectedWindows = []string{"1 hour", "1 day", "7 days", "30 days", "10 years"}

func (s *server) rejectedPage(w http.ResponseWriter, r *http.Request, u *session) {
	q := r.URL.Query()
	d := rejectedData{Window: cmp.Or(q.Get("window"), "1 day"), Reason: q.Get("reason")}
	if !slices.Contains(rejectedWindows, d.Window) {
		s.badRequest(w, r, u, &badInput{"window", d.Window, strings.Join(rejectedWindows, ", ")})
		return
	}
	mq := url.Values{"state": {"rejected"}, "reason": {d.Reason}, "sort": {"newest"}, "cursor": {q.Get("cursor")}}
	f, bad := parseMsgFilter(mq, time.Now())
	if bad != nil {
		s.badRequest(w, r, u, bad)
		return
	}
	err := s.readTx(r.Context(), func(tx pgx.Tx) error {
		var err error
		if d.Reasons, err = operate.Rows[operate.RejectedRow](r.Context(), tx, "rejected_recent.sql", map[string]string{"window": d.Window}); err != nil {
			return err
		}
		d.Rows, err = operate.Rows[listRow](r.Context(), tx, "console_messages.sql", f.vars)
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "read rejected records", err)
		return
	}
	if len(d.Rows) > f.Limit {
		d.Rows = d.Rows[:f.Limit]
		q.Set("cursor", strconv.FormatInt(d.Rows[len(d.Rows)-1].ID, 10))
		d.Next = "/rejected?" + q.Encode()
	}
	s.render(w, r, http.StatusOK, "rejected", page{Title: "Rejected records", Nav: "rejected", User: u, Data: d})
}

type targetsData struct {
	Controls []operate.TargetRow
	Overview *overviewData
	// Allowed is TARGET_TOPICS, for the page's note.
	Allowed string
}

func (s *server) targetsPage(w http.ResponseWriter, r *http.Request, u *session) {
	d := targetsData{Allowed: s.cfg.TargetTopics}
	err := s.readTx(r.Context(), func(tx pgx.Tx) error {
		var err error
		d.Controls, err = operate.Rows[operate.TargetRow](r.Context(), tx, "targets.sql", nil)
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "read target controls", err)
		return
	}
	if d.Overview, err = s.getOverview(r.Context()); err != nil {
		s.dbFail(w, r, u, "read the overview", err)
		return
	}
	s.render(w, r, http.StatusOK, "targets", page{Title: "Targets", Nav: "targets", User: u, Data: d})
}
