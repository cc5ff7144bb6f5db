package queries

import (
	"context"
	"time"
)

// InstanceHeartbeatParams are instance_heartbeat.sql's parameters.
type InstanceHeartbeatParams struct {
	ID     string // $1: the process's River client id
	MinID  int64  // $2: the highest message id the process has seen
	MinSeq int64  // $3: the highest seq
}

func (p InstanceHeartbeatParams) args() []any { return []any{p.ID, p.MinID, p.MinSeq} }

// InstanceHeartbeatRow is the id and seq sequences' values after the beat.
type InstanceHeartbeatRow struct {
	IDHigh  int64 `db:"id_high"`
	SeqHigh int64 `db:"seq_high"`
}

func (r *InstanceHeartbeatRow) dest() []any { return []any{&r.IDHigh, &r.SeqHigh} }

// InstanceHeartbeat marks the process alive (instance_heartbeat.sql).
func InstanceHeartbeat(ctx context.Context, db DBTX, p InstanceHeartbeatParams) (InstanceHeartbeatRow, error) {
	return one(ctx, db, instanceHeartbeatSQL, p.args(), (*InstanceHeartbeatRow).dest)
}

// InstanceLeaveParams are instance_leave.sql's parameters.
type InstanceLeaveParams struct {
	ID string // $1
}

func (p InstanceLeaveParams) args() []any { return []any{p.ID} }

// InstanceLeave deregisters a stopping process (instance_leave.sql).
func InstanceLeave(ctx context.Context, db DBTX, p InstanceLeaveParams) error {
	_, err := db.Exec(ctx, instanceLeaveSQL, p.args()...)
	return err
}

// InstancePrune forgets long-dead processes (instance_prune.sql).
func InstancePrune(ctx context.Context, db DBTX) error {
	_, err := db.Exec(ctx, instancePruneSQL)
	return err
}

// SessionLocalParams are session_local.sql's parameters: settings, by
// name and value, for the rest of a transaction.
type SessionLocalParams struct {
	Names  []string // $1
	Values []string // $2
}

func (p SessionLocalParams) args() []any { return []any{p.Names, p.Values} }

// SessionLocal makes settings for the rest of the transaction tx
// (session_local.sql).
func SessionLocal(ctx context.Context, tx DBTX, p SessionLocalParams) error {
	_, err := tx.Exec(ctx, sessionLocalSQL, p.args()...)
	return err
}

// SessionStateRow is what a session is (session_state.sql).
type SessionStateRow struct {
	ReadOnly        bool    `db:"read_only"`        // it takes no writes
	Isolation       string  `db:"isolation"`        // default_transaction_isolation, as SHOW writes it
	ReplicationRole string  `db:"replication_role"` // session_replication_role: origin, replica or local
	BackendPID      int32   `db:"backend_pid"`      // the server process the statement ran on
	ClientAddr      *string `db:"client_addr"`      // the address the server sees the client at; nil over a Unix socket
	ClientPort      *int32  `db:"client_port"`      // its port
}

func (r *SessionStateRow) dest() []any {
	return []any{&r.ReadOnly, &r.Isolation, &r.ReplicationRole, &r.BackendPID, &r.ClientAddr, &r.ClientPort}
}

// SessionState reads what the session is, for every program's start-up
// check and for readiness (session_state.sql).
func SessionState(ctx context.Context, db DBTX) (SessionStateRow, error) {
	return one(ctx, db, sessionStateSQL, nil, (*SessionStateRow).dest)
}

// DispatchReapLoopsParams are dispatch_reap_loops.sql's parameters.
type DispatchReapLoopsParams struct {
	Kind        string        // $1: the loop jobs' kind
	StaleAfter  time.Duration // $2: a heartbeat older than this is a dead process's
	Self        string        // $3: this process's River client id
	OrphanAfter time.Duration // $4
	Running     []int64       // $5: the loop jobs this process runs
}

func (p DispatchReapLoopsParams) args() []any {
	return []any{p.Kind, p.StaleAfter, p.Self, p.OrphanAfter, p.Running}
}

// DispatchReapLoopsRow is a loop job discarded, the process it was on, and
// whether that is this one.
type DispatchReapLoopsRow struct {
	ID     int64   `db:"id"`
	Holder *string `db:"holder"`
	Ours   bool    `db:"ours"`
}

func (r *DispatchReapLoopsRow) dest() []any { return []any{&r.ID, &r.Holder, &r.Ours} }

// DispatchReapLoops discards loop jobs no process runs
// (dispatch_reap_loops.sql).
func DispatchReapLoops(ctx context.Context, db DBTX, p DispatchReapLoopsParams) ([]DispatchReapLoopsRow, error) {
	return collect(ctx, db, dispatchReapLoopsSQL, p.args(), (*DispatchReapLoopsRow).dest)
}

// HistoryPruneParams are history_prune.sql's parameters.
type HistoryPruneParams struct {
	Retention time.Duration // $1
	Batch     int           // $2: rows per statement at most
}

func (p HistoryPruneParams) args() []any { return []any{p.Retention, p.Batch} }

// HistoryPruneRow counts the history rows pruned.
type HistoryPruneRow struct {
	Pruned int64 `db:"pruned"`
}

func (r *HistoryPruneRow) dest() []any { return []any{&r.Pruned} }

// HistoryPrune deletes history past its retention, a batch at a time
// (history_prune.sql).
func HistoryPrune(ctx context.Context, db DBTX, p HistoryPruneParams) (HistoryPruneRow, error) {
	return one(ctx, db, historyPruneSQL, p.args(), (*HistoryPruneRow).dest)
}

// MetricsBacklogRow is one row of the backlog gauges' query: a target and
// state's counts (both nil when there is no message at all), and the
// database-wide figures, repeated on every row.
type MetricsBacklogRow struct {
	Target            *string `db:"target_topic"`
	State             *string `db:"state"`
	Messages          int64   `db:"messages"`
	Due               int64   `db:"due"`
	OldestDueSeconds  float64 `db:"oldest_due"`
	HeldKeys          int64   `db:"held_keys"`
	OldestXactSeconds float64 `db:"oldest_xact"`
	HeldParked        int64   `db:"held_parked"`
	DLQUnsent         int64   `db:"dlq_unsent"`
	InflightKeys      int64   `db:"inflight_keys"`
	InflightOldest    float64 `db:"inflight_oldest"`
}

func (r *MetricsBacklogRow) dest() []any {
	return []any{&r.Target, &r.State, &r.Messages, &r.Due, &r.OldestDueSeconds, &r.HeldKeys, &r.OldestXactSeconds,
		&r.HeldParked, &r.DLQUnsent, &r.InflightKeys, &r.InflightOldest}
}

// MetricsBacklog reads the backlog gauges (metrics_backlog.sql).
func MetricsBacklog(ctx context.Context, db DBTX) ([]MetricsBacklogRow, error) {
	return collect(ctx, db, metricsBacklogSQL, NoParams{}.args(), (*MetricsBacklogRow).dest)
}
