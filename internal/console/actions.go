package console

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/operate"
)

// errPreview rolls back a preview's transaction: the preview runs the
// action's runbook file for real and shows what it returned, then undoes it.
var errPreview = errors.New("preview: rolled back")

// plan is one action, checked and ready to run: a runbook file and its
// variables.
type plan struct {
	action, title string
	// file and vars are what the action runs.
	file string
	vars map[string]string
	// what says in words what it does ("expedite the pending messages of
	// key order-42").
	what string
	// warnings are shown on the preview.
	warnings []string
	// fields are the form's fields, carried from the preview to the
	// confirmation.
	fields url.Values
}

// table is rows of a runbook file's result, for the preview and result
// pages.
type table struct {
	Cols []string
	Rows []tableRow
}

type tableRow struct {
	ID, Target string
	Cells      []string
}

// actionData is the preview and the result page.
type actionData struct {
	Action, Title, What string
	Warnings            []string
	// Count is how many rows the preview matched, or the result changed;
	// Matched, for a replay, how many messages matched, replayable or not.
	Count, Matched int
	Table          table
	// Fields are carried as hidden inputs to the confirmation.
	Fields []field
	// Typed: the operator must type Count to confirm (replay above
	// ConfirmAbove).
	Typed bool
	// Replay details.
	Groups        []replayGroup
	NotReplayable []int64
	LeftAlone     int
	// Back is where to go after.
	Back string
}

type field struct{ Name, Value string }

type replayGroup struct {
	Target, Reason string
	Messages       int
}

func (s *server) action(w http.ResponseWriter, r *http.Request, u *session) {
	name := r.PathValue("action")
	if !u.operator() {
		s.fail(w, r, u, http.StatusForbidden, fmt.Sprintf("You (%s) are a viewer: viewers may look at everything but not act. Ask an operator; nothing was changed.", u.name))
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 4<<20)
	if err := r.ParseForm(); err != nil {
		s.fail(w, r, u, http.StatusBadRequest, "The form could not be read ("+err.Error()+"); nothing was changed.")
		return
	}
	if why := s.checkCSRF(r, u); why != "" {
		s.fail(w, r, u, http.StatusForbidden, why)
		return
	}
	confirm := r.PostFormValue("confirm") != ""
	if name == "replay" {
		s.replay(w, r, u, confirm)
		return
	}
	p, bad := s.planAction(name, r.PostForm)
	if bad != nil {
		if bad.Field == "action" {
			s.fail(w, r, u, http.StatusNotFound, fmt.Sprintf("There is no action %q: actions are expedite, cancel, park, replay, fix, pause, resume, limit, unlimit, weight. Nothing was changed.", name))
			return
		}
		s.badRequest(w, r, u, bad)
		return
	}
	d := actionData{Action: p.action, Title: p.title, What: p.what, Warnings: p.warnings, Fields: fields(p.fields),
		Back: safeNext(cmp.Or(r.PostFormValue("back"), "/"))}
	ctx := r.Context()
	run := func(tx pgx.Tx) error {
		t, err := runTable(ctx, tx, p.file, p.vars)
		d.Table = t
		return err
	}
	if !confirm {
		err := s.tx(ctx, pgx.TxOptions{}, "console:"+u.name, func(tx pgx.Tx) error {
			if err := run(tx); err != nil {
				return err
			}
			return errPreview
		})
		if !errors.Is(err, errPreview) {
			s.dbFail(w, r, u, "preview "+p.title, err)
			return
		}
		d.Count = len(d.Table.Rows)
		pg := page{Title: "Preview: " + p.title, User: u, Data: d}
		if d.Count == 0 {
			pg.Error = "This matches nothing: " + p.what + " would change nothing, so there is nothing to confirm."
		}
		s.render(w, r, http.StatusOK, "preview", pg)
		return
	}
	if err := s.writeTx(ctx, u, run); err != nil {
		s.dbFail(w, r, u, p.title, err)
		return
	}
	d.Count = len(d.Table.Rows)
	s.logger.Info("console action", "user", u.name, "action", p.action, "what", p.what, "changed", d.Count)
	s.overviewStale()
	pg := page{Title: "Done: " + p.title, User: u, Data: d}
	if d.Count == 0 {
		pg.Notice = "Nothing changed: what the preview showed changed in the meantime (delivered, cancelled or moved by someone else)."
	}
	s.render(w, r, http.StatusOK, "result", pg)
}

// overviewStale makes the next overview count again, so that an action
// shows at once.
func (s *server) overviewStale() {
	s.overviewMu.Lock()
	s.overview = nil
	s.overviewMu.Unlock()
}

func fields(v url.Values) []field {
	var out []field
	keys := make([]string, 0, len(v))
	for k := range v {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		for _, x := range v[k] {
			out = append(out, field{k, x})
		}
	}
	return out
}

// parseIDs reads message ids: fields named ids, each one or more ids
// separated by commas or blanks.
func parseIDs(values []string) ([]int64, *badInput) {
	var ids []int64
	for _, v := range values {
		for _, p := range strings.FieldsFunc(v, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' || r == '\r' }) {
			id, err := strconv.ParseInt(p, 10, 64)
			if err != nil || id <= 0 {
				return nil, &badInput{"ids", v, "message ids: positive integers separated by commas"}
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	return ids, nil
}

func idList(ids []int64) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(parts, ",")
}

// planAction checks the form of action name.
func (s *server) planAction(name string, form url.Values) (plan, *badInput) {
	p := plan{action: name, fields: url.Values{}}
	get := func(k string) string {
		v := strings.TrimSpace(form.Get(k))
		if v != "" {
			p.fields.Set(k, v)
		}
		return v
	}
	ids := func(required bool) (string, *badInput) {
		list, bad := parseIDs(form["ids"])
		if bad != nil {
			return "", bad
		}
		if len(list) == 0 && required {
			return "", &badInput{"ids", "", "one or more message ids, separated by commas"}
		}
		p.fields.Set("ids", idList(list))
		return idList(list), nil
	}
	target := func() (string, *badInput) {
		t := get("target")
		if t == "" {
			return "", &badInput{"target", "", "a target topic name"}
		}
		return t, nil
	}
	switch name {
	case "expedite":
		switch scope := get("scope"); scope {
		case "id", "":
			list, bad := ids(true)
			if bad != nil {
				return p, bad
			}
			p.file, p.vars, p.what = "expedite_id.sql", map[string]string{"ids": list}, "make message(s) "+list+" due now"
		case "key":
			k := form.Get("key") // exact: blanks are part of a key
			if k == "" {
				return p, &badInput{"key", "", "a business key"}
			}
			p.fields.Set("key", k)
			p.file, p.vars, p.what = "expedite_key.sql", map[string]string{"key": k}, "make the waiting messages of key "+strconv.Quote(k)+" due now"
		case "target":
			t, bad := target()
			if bad != nil {
				return p, bad
			}
			p.file, p.vars, p.what = "expedite_target.sql", map[string]string{"target": t}, "make every waiting message to "+t+" due now"
		default:
			return p, &badInput{"scope", scope, "id, key or target"}
		}
		p.title = "Expedite"
	case "cancel":
		list, bad := ids(true)
		if bad != nil {
			return p, bad
		}
		p.title, p.file, p.vars, p.what = "Cancel", "cancel_id.sql", map[string]string{"ids": list}, "delete message(s) "+list+" for good (no undo)"
	case "park":
		list, bad := ids(true)
		if bad != nil {
			return p, bad
		}
		why := get("why")
		if why == "" {
			return p, &badInput{"why", "", "a reason, e.g. a ticket number: it is stored in the message's reason"}
		}
		release := "false"
		if form.Get("release") != "" {
			release = "true"
			p.fields.Set("release", "true")
		}
		p.title, p.file = "Park", "park_id.sql"
		p.vars = map[string]string{"ids": list, "why": why, "release": release}
		p.what = "park message(s) " + list + " (" + why + ")"
		if release == "true" {
			p.what += ", releasing their keys"
		}
	case "fix":
		list, bad := ids(true)
		if bad != nil {
			return p, bad
		}
		t := get("target")
		due := get("due")
		dueVar := ""
		if due != "" {
			when, err := parseDue(due, time.Now())
			if err != nil {
				return p, &badInput{"due", due, "an RFC 3339 time, a date and time (2024-05-01T12:00, UTC), a duration from now (10m), or empty for now"}
			}
			dueVar = when.UTC().Format(time.RFC3339Nano)
		}
		if t != "" {
			s.warnTarget(&p, t)
		}
		p.title, p.file = "Fix and requeue", "fix_rejected.sql"
		p.vars = map[string]string{"ids": list, "target": t, "due": dueVar}
		p.what = "requeue rejected record(s) " + list
		if t != "" {
			p.what += " to " + t
		}
		if dueVar != "" {
			p.what += ", due " + dueVar
		}
	case "pause", "resume", "limit", "unlimit", "weight":
		t, bad := target()
		if bad != nil {
			return p, bad
		}
		p.vars = map[string]string{"target": t}
		switch name {
		case "pause":
			p.vars["note"] = get("note")
			p.title, p.file, p.what = "Pause", "pause_target.sql", "pause "+t
			s.warnTarget(&p, t)
		case "resume":
			p.title, p.file, p.what = "Resume", "resume_target.sql", "resume "+t
		case "limit":
			raw := get("rate")
			rate, err := strconv.ParseFloat(raw, 64)
			if err != nil || rate <= 0 || math.IsInf(rate, 0) || math.IsNaN(rate) {
				return p, &badInput{"rate", raw, "messages per second, a number > 0 (fractions allowed)"}
			}
			p.vars["rate"] = strconv.FormatFloat(rate, 'f', -1, 64)
			p.title, p.file, p.what = "Rate limit", "limit_target.sql", "limit "+t+" to "+p.vars["rate"]+" messages/s"
		case "unlimit":
			p.title, p.file, p.what = "Lift rate limit", "unlimit_target.sql", "lift the rate limit of "+t
		case "weight":
			raw := get("weight")
			weight, err := strconv.Atoi(strings.TrimSpace(raw))
			if err != nil || weight < 1 || weight > operate.MaxTargetWeight {
				return p, &badInput{"weight", raw, fmt.Sprintf("a whole number from 1 to %d (1 is the default): the target's heads per turn of each claim",
					operate.MaxTargetWeight)}
			}
			p.vars["weight"] = strconv.Itoa(weight)
			p.title, p.file, p.what = "Weight", "weight_target.sql", "give "+t+" weight "+p.vars["weight"]
		}
	default:
		return p, &badInput{Field: "action", Value: name}
	}
	return p, nil
}

// warnTarget warns when TARGET_TOPICS does not allow topic.
func (s *server) warnTarget(p *plan, topic string) {
	if s.cfg.TargetAllowed != nil && !s.cfg.TargetAllowed(topic) {
		p.warnings = append(p.warnings, fmt.Sprintf("%s is outside TARGET_TOPICS (%s): dispatch refuses to publish there and parks what it would send (target_not_allowed). Check the name.",
			topic, cmp.Or(s.cfg.TargetTopics, "empty: no topic allowed")))
	}
}

// parseDue reads a due time: a point in time, or a duration from now.
func parseDue(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(d), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range []string{"2006-01-02T15:04", "2006-01-02T15:04:05", "2006-01-02 15:04"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, errors.New("not a time")
}

// runTable runs a one-statement runbook file and returns its rows as text.
func runTable(ctx context.Context, tx pgx.Tx, file string, vars map[string]string) (table, error) {
	sts, err := operate.Statements(file, vars)
	if err != nil {
		return table{}, err
	}
	if len(sts) != 1 {
		return table{}, fmt.Errorf("runbook %s: %d statements, want 1", file, len(sts))
	}
	rows, err := tx.Query(ctx, sts[0].SQL, sts[0].Args...)
	if err != nil {
		return table{}, operate.ExplainDBError(file, err)
	}
	defer rows.Close()
	var t table
	for _, fd := range rows.FieldDescriptions() {
		t.Cols = append(t.Cols, fd.Name)
	}
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			return t, operate.ExplainDBError(file, err)
		}
		var row tableRow
		for i, v := range vals {
			cell := cellText(v)
			switch t.Cols[i] {
			case "id":
				row.ID = cell
			case "target_topic":
				row.Target = cell
			}
			row.Cells = append(row.Cells, cell)
		}
		t.Rows = append(t.Rows, row)
	}
	if err := rows.Err(); err != nil {
		return t, operate.ExplainDBError(file, err)
	}
	return t, nil
}

func cellText(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case time.Time:
		return formatTime(x)
	case string:
		return printable(x)
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case []byte:
		return fmt.Sprintf("\\x%x", x)
	default:
		return fmt.Sprint(x)
	}
}

// replayFilter is the replay form's filters.
type replayFilter struct {
	state string
	vars  map[string]string
	what  []string
}

func (s *server) parseReplay(form url.Values, keep url.Values) (replayFilter, *badInput) {
	f := replayFilter{state: cmp.Or(strings.TrimSpace(form.Get("state")), "parked"),
		vars: map[string]string{"ids": "", "target": "", "key": "", "error_class": "", "reason": "", "since": "", "until": ""}}
	if f.state != "parked" && f.state != "rejected" {
		return f, &badInput{"state", f.state, "parked or rejected"}
	}
	keep.Set("state", f.state)
	ids, bad := parseIDs(form["ids"])
	if bad != nil {
		return f, bad
	}
	if len(ids) > 0 {
		f.vars["ids"] = idList(ids)
		keep.Set("ids", idList(ids))
		f.what = append(f.what, "ids "+idList(ids))
	}
	now := time.Now()
	for _, name := range []string{"target", "key", "error_class", "reason", "since", "until"} {
		v := form.Get(name)
		if name != "key" {
			v = strings.TrimSpace(v)
		}
		if v == "" {
			continue
		}
		keep.Set(name, v)
		var err error
		switch name {
		case "key":
			f.vars["key"] = v
		case "target", "error_class":
			if f.vars[name], err = operate.GlobToLike(v); err != nil {
				return f, &badInput{name, v, "a glob: * any run of characters, ? one, \\ quotes (" + err.Error() + ")"}
			}
		case "reason":
			if strings.Contains(v, ":") {
				return f, &badInput{"reason", v, "a reason code, the part before the colon (e.g. unknown_topic)"}
			}
			f.vars["reason"] = v
		case "since", "until":
			t, err := parseWhen(v, now)
			if err != nil {
				return f, &badInput{name, v, "an RFC 3339 time, a date and time (2024-05-01T12:00, UTC) or a duration meaning that long ago (90m, 48h)"}
			}
			f.vars[name] = t.UTC().Format(time.RFC3339Nano)
		}
		f.what = append(f.what, name+" "+strconv.Quote(v))
	}
	if len(f.what) == 0 {
		return f, &badInput{"filters", "", "at least one filter (ids, target, key, error_class, reason, since, until), so that replaying every " +
			f.state + " message is never an accident; target * means every target"}
	}
	return f, nil
}

// replay previews (replay_preview.sql) and, confirmed, replays the
// previewed ids (replay.sql), as `scheduler replay` does.
func (s *server) replay(w http.ResponseWriter, r *http.Request, u *session, confirm bool) {
	keep := url.Values{}
	f, bad := s.parseReplay(r.PostForm, keep)
	if bad != nil {
		s.badRequest(w, r, u, bad)
		return
	}
	var rate string
	if raw := strings.TrimSpace(r.PostFormValue("rate")); raw != "" {
		v, err := strconv.ParseFloat(raw, 64)
		if err != nil || v <= 0 || math.IsInf(v, 0) || math.IsNaN(v) {
			s.badRequest(w, r, u, &badInput{"rate", raw, "messages per second, a number > 0, or empty: all due now"})
			return
		}
		rate = strconv.FormatFloat(v, 'f', -1, 64)
		keep.Set("rate", rate)
	}
	reset := r.PostFormValue("reset_attempts") != ""
	if reset {
		keep.Set("reset_attempts", "true")
	}
	what := "replay " + f.state + " messages matching " + strings.Join(f.what, ", ")
	if rate != "" {
		what += " at " + rate + "/s"
	}
	if reset {
		what += ", attempts reset to 0"
	}
	d := actionData{Action: "replay", Title: "Replay", What: what, Back: safeNext(cmp.Or(r.PostFormValue("back"), "/parked"))}
	ctx := r.Context()
	if !confirm {
		var cands []operate.ReplayCandidate
		err := s.readTx(ctx, func(tx pgx.Tx) error {
			var err error
			cands, err = operate.Rows[operate.ReplayCandidate](ctx, tx, "replay_preview.sql", mergeVars(f.vars, "state", f.state))
			return err
		})
		if err != nil {
			s.dbFail(w, r, u, "preview the replay", err)
			return
		}
		var replayable []int64
		targets := map[string]bool{}
		for _, c := range cands {
			if c.Replayable {
				replayable = append(replayable, c.ID)
				targets[deref(c.TargetTopic)] = true
			} else {
				d.NotReplayable = append(d.NotReplayable, c.ID)
			}
		}
		for _, t := range slices.Sorted(mapKeys(targets)) {
			p := plan{}
			s.warnTarget(&p, t)
			d.Warnings = append(d.Warnings, p.warnings...)
		}
		d.Groups = groupCandidates(cands)
		d.Count, d.Matched = len(replayable), len(cands)
		d.Table = candidateTable(cands)
		keep.Set("previewed", idList(replayable))
		d.Fields = fields(keep)
		d.Typed = d.Count > s.cfg.ConfirmAbove
		pg := page{Title: "Preview: replay", User: u, Data: d}
		switch {
		case len(cands) == 0:
			pg.Error = "No " + f.state + " message matches " + strings.Join(f.what, ", ") + ": nothing would be replayed, so there is nothing to confirm."
		case d.Count == 0:
			pg.Error = "None of the matching messages can be replayed: a rejected record that named no target topic has nowhere to go (fix it first)."
		}
		s.render(w, r, http.StatusOK, "preview", pg)
		return
	}
	previewed, bad := parseIDs(r.PostForm["previewed"])
	if bad != nil {
		bad.Field = "previewed"
		s.badRequest(w, r, u, bad)
		return
	}
	if len(previewed) == 0 {
		s.badRequest(w, r, u, &badInput{"previewed", "", "the ids the preview listed: preview the replay first"})
		return
	}
	if len(previewed) > s.cfg.ConfirmAbove {
		if typed := strings.TrimSpace(r.PostFormValue("typed")); typed != strconv.Itoa(len(previewed)) {
			s.fail(w, r, u, http.StatusBadRequest, fmt.Sprintf("Not confirmed: this replays %d messages; type %d in the confirmation field (you typed %q). Nothing was changed.",
				len(previewed), len(previewed), typed))
			return
		}
	}
	vars := mergeVars(f.vars, "state", f.state)
	vars["ids"] = idList(previewed)
	vars["rate"] = rate
	vars["reset_attempts"] = strconv.FormatBool(reset)
	err := s.writeTx(ctx, u, func(tx pgx.Tx) error {
		t, err := runTable(ctx, tx, "replay.sql", vars)
		d.Table = t
		return err
	})
	if err != nil {
		s.dbFail(w, r, u, "replay", err)
		return
	}
	d.Count = len(d.Table.Rows)
	d.LeftAlone = len(previewed) - d.Count
	s.logger.Info("console action", "user", u.name, "action", "replay", "what", what, "changed", d.Count)
	s.overviewStale()
	pg := page{Title: "Done: replay", User: u, Data: d}
	if d.LeftAlone > 0 {
		pg.Notice = fmt.Sprintf("%d of the %d previewed messages changed since the preview and were left alone.", d.LeftAlone, len(previewed))
	}
	s.render(w, r, http.StatusOK, "result", pg)
}

func mergeVars(v map[string]string, k, val string) map[string]string {
	out := make(map[string]string, len(v)+1)
	for a, b := range v {
		out[a] = b
	}
	out[k] = val
	return out
}

func mapKeys(m map[string]bool) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func groupCandidates(cands []operate.ReplayCandidate) []replayGroup {
	var groups []replayGroup
	for _, c := range cands {
		t, rc := deref(c.TargetTopic), reasonCode(c.Reason)
		i := slices.IndexFunc(groups, func(g replayGroup) bool { return g.Target == t && g.Reason == rc })
		if i < 0 {
			groups = append(groups, replayGroup{Target: t, Reason: rc})
			i = len(groups) - 1
		}
		groups[i].Messages++
	}
	slices.SortStableFunc(groups, func(a, b replayGroup) int {
		return cmp.Or(cmp.Compare(b.Messages, a.Messages), cmp.Compare(a.Target, b.Target), cmp.Compare(a.Reason, b.Reason))
	})
	return groups
}

// candidatesShown is how many matching messages a replay preview lists.
const candidatesShown = 100

func candidateTable(cands []operate.ReplayCandidate) table {
	t := table{Cols: []string{"id", "business_key", "target_topic", "since", "redrive_count", "reason", "holds_key", "replayable"}}
	for _, c := range cands[:min(len(cands), candidatesShown)] {
		id := strconv.FormatInt(c.ID, 10)
		t.Rows = append(t.Rows, tableRow{ID: id, Target: deref(c.TargetTopic), Cells: []string{
			id, printable(deref(c.BusinessKey)), deref(c.TargetTopic), formatTime(c.Since), strconv.Itoa(int(c.RedriveCount)),
			printable(deref(c.Reason)), strconv.FormatBool(c.HoldsKey), strconv.FormatBool(c.Replayable)}})
	}
	return t
}
