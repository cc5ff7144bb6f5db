package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

// cli runs an operator command of the built binary with env and returns
// its stdout, its stderr and its exit code.
func cli(t *testing.T, env []string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), args...)
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if _, exited := err.(*exec.ExitError); err != nil && !exited {
		t.Fatalf("scheduler %s: %v", strings.Join(args, " "), err)
	}
	return stdout.String(), stderr.String(), cmd.ProcessState.ExitCode()
}

// cliOK runs an operator command that must succeed without a word on
// stderr, and returns its stdout.
func cliOK(t *testing.T, env []string, args ...string) string {
	t.Helper()
	out, errOut, code := cli(t, env, args...)
	if code != 0 || errOut != "" {
		t.Fatalf("scheduler %s: exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, out, errOut)
	}
	return out
}

// idsOf returns the ids of the JSON array of messages `ls --json` prints.
func idsOf(t *testing.T, out string) []int64 {
	t.Helper()
	var ms []struct {
		ID int64 `json:"id"`
	}
	if err := json.Unmarshal([]byte(out), &ms); err != nil {
		t.Fatalf("ls --json: %v\n%s", err, out)
	}
	ids := make([]int64, len(ms))
	for i, m := range ms {
		ids[i] = m.ID
	}
	return ids
}

// One reason code from end to end: a message parked for real (its target
// topic does not exist on the broker), a record ingest parks (class
// permanent) and one it rejects (no target) carry in their rows the code
// their metric is labelled with, and `ls --reason` and `replay --reason`
// find them by it; an operator's park is `operator`. Every change an
// operator makes is in the history with who made it, and `show` tells how a
// message's story ended.
func TestReasonCodesAndHistoryFromRealParks(t *testing.T) {
	const missingTopic = "orders.missing" // allowed by TARGET_TOPICS, absent from the broker
	brokers := broker(t)
	db := pgtest.NewDB(t)
	p := start(t, append(serviceEnv(db.URL, brokers, "e2e-reasons"), "METRICS_INTERVAL=200ms"))
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)
	for _, m := range []*sarama.ProducerMessage{
		deferRecord("gone-1", "v", "defer.target", missingTopic, "defer.delay", "0"),
		deferRecord("perm-1", "v", "defer.target", targetTopic, "defer.error.class", "permanent"),
		deferRecord("nowhere-1", "v", "defer.delay", "0"),
		deferRecord("later-1", "v", "defer.target", targetTopic, "defer.delay", "1h"),
		deferRecord("later-2", "v", "defer.target", targetTopic, "defer.delay", "1h"),
		deferRecord("later-3", "v", "defer.target", targetTopic, "defer.delay", "1h"),
		deferRecord("now-1", "v", "defer.target", targetTopic, "defer.delay", "0"),
	} {
		if _, _, err := prod.SendMessage(m); err != nil {
			t.Fatal(err)
		}
	}
	waitRows(t, db.Pool, 30*time.Second, `SELECT count(*) FROM deferred_message WHERE state = 'parked' AND business_key = 'gone-1'`, 1)
	// Due at once, it waits behind the parked message holding its key.
	if _, _, err := prod.SendMessage(deferRecord("gone-1", "v", "defer.target", missingTopic, "defer.delay", "0")); err != nil {
		t.Fatal(err)
	}
	out.until(t, 30*time.Second, "now-1 delivered", atLeast(1))
	waitRows(t, db.Pool, 30*time.Second, `SELECT count(*) FROM deferred_message`, 7)

	var parkedID, laterID, later2ID, later3ID, nowID int64
	for q, dst := range map[string]*int64{
		`SELECT id FROM deferred_message WHERE business_key = 'gone-1' AND state = 'parked'`: &parkedID,
		`SELECT id FROM deferred_message WHERE business_key = 'later-1'`:                     &laterID,
		`SELECT id FROM deferred_message WHERE business_key = 'later-2'`:                     &later2ID,
		`SELECT id FROM deferred_message WHERE business_key = 'later-3'`:                     &later3ID,
		`SELECT message_id FROM deferred_attempt WHERE event = 'published'`:                  &nowID,
	} {
		if err := db.Pool.QueryRow(t.Context(), q).Scan(dst); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}

	// The stored codes are the metrics' labels.
	codes := map[string]string{}
	rows, err := db.Pool.Query(t.Context(), `SELECT business_key, split_part(reason, ':', 1) FROM deferred_message WHERE reason IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var key, code string
		if err := rows.Scan(&key, &code); err != nil {
			t.Fatal(err)
		}
		codes[key] = code
	}
	if codes["gone-1"] != "unknown_topic" || codes["perm-1"] != "permanent" || codes["nowhere-1"] != "missing_target" {
		t.Errorf("stored reason codes %v, want gone-1 unknown_topic, perm-1 permanent, nowhere-1 missing_target", codes)
	}
	waitMetrics(t, p, 10*time.Second, "the park counted", func(s metricsSnapshot) bool {
		return s.is(1, metrics.DispatchParked, "target", missingTopic, "reason", codes["gone-1"]) &&
			s.is(1, metrics.IngestParked, "reason", codes["perm-1"]) &&
			s.is(1, metrics.IngestRejected, "reason", codes["nowhere-1"])
	})

	env := []string{"DATABASE_URL=" + db.URL, "USER=alice", "PATH=" + os.Getenv("PATH")}
	// ls and replay find them by the same codes.
	for code, want := range map[string]int64{"unknown_topic": parkedID, "permanent": 0, "missing_target": 0} {
		ids := idsOf(t, cliOK(t, env, "ls", "--reason", code, "--json"))
		if len(ids) != 1 || (want != 0 && ids[0] != want) {
			t.Errorf("ls --reason %s: %v, want one message (%d)", code, ids, want)
		}
	}
	preview := cliOK(t, env, "replay", "--target", "orders.*", "--reason", "unknown_topic", "--dry-run")
	if !strings.Contains(preview, "1 parked message matches") || !strings.Contains(preview, "dry run: would replay 1 message") {
		t.Errorf("replay --reason unknown_topic --dry-run:\n%s", preview)
	}
	// It says it could not check TARGET_TOPICS, and warns when they do not
	// allow the target.
	if !strings.Contains(preview, "TARGET_TOPICS is not set in this environment") {
		t.Errorf("the preview does not say TARGET_TOPICS could not be checked:\n%s", preview)
	}
	refused := cliOK(t, append(env, "TARGET_TOPICS=payments.*"), "replay", idArg(parkedID), "--dry-run")
	if !strings.Contains(refused, "Warning: TARGET_TOPICS (payments.*) does not allow "+missingTopic) {
		t.Errorf("the preview does not warn about a target outside TARGET_TOPICS:\n%s", refused)
	}
	if allowed := cliOK(t, append(env, "TARGET_TOPICS=orders.*"), "replay", idArg(parkedID), "--dry-run"); strings.Contains(allowed, "Warning") {
		t.Errorf("the preview warns although TARGET_TOPICS allows the target:\n%s", allowed)
	}

	// status says why the due message of gone-1 waits.
	status := cliOK(t, env, "status")
	if !strings.Contains(status, "1 in a key held by a parked message") {
		t.Errorf("status does not say why the due message waits:\n%s", status)
	}

	// An operator's park is code operator, and the history names who.
	cliOK(t, env, "park", "--why", "bad address", idArg(laterID))
	if ids := idsOf(t, cliOK(t, env, "ls", "--reason", "operator", "--json")); len(ids) != 1 || ids[0] != laterID {
		t.Errorf("ls --reason operator: %v, want [%d]", ids, laterID)
	}
	cliOK(t, env, "expedite", "--id", idArg(later2ID)) // and dispatch publishes it (the service acts: no actor)
	cliOK(t, env, "cancel", idArg(later3ID))
	var actors string
	// Each deferral, the service's, is written with the first operator's
	// event of its message (migration 0012), but recorded at when it was
	// stored, so the events read in the order they happened.
	if err := db.Pool.QueryRow(t.Context(), `SELECT string_agg(event || '=' || coalesce(actor, '-'), ','
		                                            ORDER BY recorded_at, id NULLS LAST, event <> 'deferred')
		FROM deferred_history WHERE message_id = ANY ($1) AND event <> 'published'`, []int64{laterID, later2ID, later3ID}).Scan(&actors); err != nil {
		t.Fatal(err)
	}
	if actors != "deferred=-,deferred=-,deferred=-,parked=cli:alice,expedited=cli:alice,cancelled=cli:alice" {
		t.Errorf("history events and actors: %s", actors)
	}

	// show tells the end of every story.
	if s := cliOK(t, env, "show", idArg(nowID)); !strings.Contains(s, "delivered: published to "+targetTopic+" partition ") {
		t.Errorf("show of a delivered message:\n%s", s)
	}
	if s := cliOK(t, env, "show", "--id", idArg(later3ID)); !strings.Contains(s, "cancelled by cli:alice at ") ||
		!strings.Contains(s, "cli:alice\n") {
		t.Errorf("show of a cancelled message:\n%s", s)
	}

	// Target controls are recorded with who, and targets shows it.
	cliOK(t, env, "limit", targetTopic, "--rate", "50")
	if tg := cliOK(t, env, "targets"); !strings.Contains(tg, "cli:alice") {
		t.Errorf("targets does not say who limited %s:\n%s", targetTopic, tg)
	}
	_, warned, code := cli(t, append(env, "TARGET_TOPICS=orders.*"), "pause", "payments.retry")
	if code != 0 || !strings.Contains(warned, "warning: TARGET_TOPICS (orders.*) does not allow payments.retry") {
		t.Errorf("pause of a target outside TARGET_TOPICS: exit %d, stderr:\n%s", code, warned)
	}
}

func idArg(id int64) string { return strconv.FormatInt(id, 10) }
