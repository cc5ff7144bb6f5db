// Package inflight releases the keys that deferred_inflight holds for a
// consumer group once the group has committed past the record the scheduler
// republished. Until then the key-state query answers that the key is
// blocked for that group (reason in_flight): the group has not yet
// consumed, or not yet committed, the record that went out before the ones
// it would defer next, so letting it go on with the key could reorder it.
//
// Every replica runs a Releaser. Each tick reads which groups and target
// partitions hold rows, asks each group's coordinator for its committed
// offsets there (one request per group), waits until ingest has stored
// everything produced to the defer topic so far (what the consumer sent
// back before it committed must be in place first), and deletes, in one
// statement, every row whose record the group's committed offset has
// passed. A trigger on deferred_inflight then lifts the 'in-flight' lease
// of keys with no row left, so that dispatch may claim them again
// (docs/design.md section 23.3). The deletes are idempotent, so replicas
// need no coordination.
package inflight

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/sql/queries"
)

// DefaultInterval is how often a Releaser looks when given no interval: a
// key stays blocked for about this long after its group commits.
const DefaultInterval = time.Second

// Offsets reads consumer groups' committed offsets.
type Offsets interface {
	// Committed returns group's committed offset (the next offset the group
	// will read) for each partition of partitions, by topic and partition.
	// A partition the group has committed nothing for is -1 or absent.
	// With an error it returns the offsets it could read, possibly none.
	Committed(ctx context.Context, group string, partitions map[string][]int32) (map[string]map[int32]int64, error)
}

// AdminOffsets reads committed offsets with a sarama ClusterAdmin, one
// OffsetFetch request to the group's coordinator per call.
type AdminOffsets struct {
	admin sarama.ClusterAdmin
}

// NewAdminOffsets returns Offsets backed by admin, which the caller closes.
func NewAdminOffsets(admin sarama.ClusterAdmin) *AdminOffsets {
	return &AdminOffsets{admin: admin}
}

// Committed implements Offsets. sarama's call takes no context and retries
// a moving coordinator for up to several network timeouts, so it runs
// aside: a cancelled ctx returns at once, which keeps shutdown within
// SHUTDOWN_TIMEOUT when the brokers stop answering. The abandoned request
// ends by itself within its timeouts.
func (a *AdminOffsets) Committed(ctx context.Context, group string, partitions map[string][]int32) (map[string]map[int32]int64, error) {
	type result struct {
		resp *sarama.OffsetFetchResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := a.admin.ListConsumerGroupOffsets(group, partitions)
		done <- result{resp, err}
	}()
	var r result
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case r = <-done:
	}
	out := make(map[string]map[int32]int64, len(partitions))
	if errors.Is(r.err, sarama.ErrGroupIDNotFound) {
		// A group that never committed, or was deleted, is known to newer
		// brokers by this error instead of offsets of -1; the same answer:
		// nothing to release (an operator releases a deleted group's keys).
		return out, nil
	}
	if r.err != nil {
		return nil, r.err
	}
	var errs []error
	for topic, parts := range partitions {
		out[topic] = make(map[int32]int64, len(parts))
		for _, p := range parts {
			b := r.resp.GetBlock(topic, p)
			switch {
			case b == nil:
				// Not in the answer: nothing known, so nothing released.
			case !errors.Is(b.Err, sarama.ErrNoError):
				errs = append(errs, fmt.Errorf("%s/%d: %w", topic, p, b.Err))
			default:
				out[topic][p] = b.Offset
			}
		}
	}
	return out, errors.Join(errs...)
}

// Ingest says whether ingest has stored everything produced to the defer
// topic so far (keygate.Server does).
type Ingest interface {
	CaughtUp(ctx context.Context, wait time.Duration) error
}

// Releaser deletes the deferred_inflight rows whose group has committed past
// their record.
type Releaser struct {
	db       queries.DBTX
	offsets  Offsets
	ingest   Ingest
	interval time.Duration
	metrics  *metrics.Metrics
	log      *slog.Logger

	// failing are the groups whose last fetch failed, and dbFailing whether
	// the last statement did: each outage is logged when it starts and when
	// it ends, not on every tick. Only Run's goroutine touches them.
	failing   map[string]bool
	dbFailing bool
}

// New returns a Releaser over db that reads committed offsets with offsets
// every interval (DefaultInterval if not positive), and releases only once
// ingest has caught up with the defer topic (ingest nil: at once; tests).
// m may be nil.
func New(db queries.DBTX, offsets Offsets, ingest Ingest, interval time.Duration, m *metrics.Metrics, log *slog.Logger) *Releaser {
	if interval <= 0 {
		interval = DefaultInterval
	}
	return &Releaser{db: db, offsets: offsets, ingest: ingest, interval: interval, metrics: m, log: log,
		failing: map[string]bool{}}
}

// Run releases what the groups committed past, every interval, until ctx is
// done.
func (r *Releaser) Run(ctx context.Context) {
	t := time.NewTicker(r.interval)
	defer t.Stop()
	for {
		r.tick(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// tick runs one round and returns how many rows it released.
func (r *Releaser) tick(ctx context.Context) int64 {
	parts, err := queries.InflightPartitions(ctx, r.db)
	if err != nil {
		r.dbFailed(ctx, "read the partitions of deferred_inflight", err)
		return 0
	}
	// The rows come ordered by group, so each group's partitions are a run.
	var p queries.InflightReleaseParams
	seen := map[string]bool{}
	for start := 0; start < len(parts); {
		end := start + 1
		for end < len(parts) && parts[end].GroupID == parts[start].GroupID {
			end++
		}
		group := parts[start].GroupID
		seen[group] = true
		r.collect(ctx, group, parts[start:end], &p)
		if ctx.Err() != nil {
			return 0
		}
		start = end
	}
	for g := range r.failing {
		if !seen[g] {
			delete(r.failing, g) // nothing of it is held any more
		}
	}
	if len(p.Groups) == 0 {
		r.dbRecovered()
		return 0
	}
	// A consumer produces what it defers (a record that failed again, or
	// one gated behind its key) before it commits past the record that
	// came back, and the key's next message must not be claimed before
	// those are stored: they may go ahead of it. So the commits just read
	// release a key only once ingest has stored everything produced to the
	// defer topic until now (docs/design.md section 23.3); else the next
	// tick tries again.
	if r.ingest != nil {
		if err := r.ingest.CaughtUp(ctx, r.interval); err != nil {
			r.log.Debug("in-flight release waits for ingest", "error", err)
			return 0
		}
	}
	row, err := queries.InflightRelease(ctx, r.db, p)
	if err != nil {
		r.dbFailed(ctx, "release in-flight keys", err)
		return 0
	}
	r.dbRecovered()
	r.metrics.InflightReleased(row.Released)
	if row.Released > 0 {
		// Debug: under load this is every tick.
		r.log.Debug("released in-flight keys", "keys", row.Released, "partitions", len(p.Groups))
	}
	return row.Released
}

// collect asks group for its committed offsets on parts and adds to p the
// partitions whose committed offset passed their oldest in-flight record.
func (r *Releaser) collect(ctx context.Context, group string, parts []queries.InflightPartitionsRow, p *queries.InflightReleaseParams) {
	ask := map[string][]int32{}
	for _, x := range parts {
		ask[x.TargetTopic] = append(ask[x.TargetTopic], x.Partition)
	}
	committed, err := r.offsets.Committed(ctx, group, ask)
	if ctx.Err() != nil {
		return // shutting down: not a failure
	}
	switch {
	case err != nil:
		r.metrics.InflightError()
		if !r.failing[group] {
			r.log.Warn("reading a consumer group's committed offsets failed; its in-flight keys stay blocked until it works again",
				"group", group, "error", err)
		}
		r.failing[group] = true
	case r.failing[group]:
		r.log.Info("reading a consumer group's committed offsets works again", "group", group)
		delete(r.failing, group)
	}
	for _, x := range parts {
		c, ok := committed[x.TargetTopic][x.Partition]
		// -1: the group has committed nothing there. Equal to the oldest
		// record: that record is the next the group will read.
		if !ok || c <= x.OldestOffset {
			continue
		}
		p.Groups = append(p.Groups, group)
		p.Topics = append(p.Topics, x.TargetTopic)
		p.Partitions = append(p.Partitions, x.Partition)
		p.Committed = append(p.Committed, c)
	}
}

func (r *Releaser) dbFailed(ctx context.Context, what string, err error) {
	if ctx.Err() != nil {
		return
	}
	if !r.dbFailing {
		r.log.Warn(what+" failed; in-flight keys stay blocked until it works again", "error", err)
	}
	r.dbFailing = true
}

func (r *Releaser) dbRecovered() {
	if r.dbFailing {
		r.log.Info("releasing in-flight keys works again")
	}
	r.dbFailing = false
}
