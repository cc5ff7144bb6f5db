package queries

import "context"

// InflightPartitionsRow is a consumer group's target partition that
// deferred_inflight holds keys for, and the lowest record offset held there.
type InflightPartitionsRow struct {
	GroupID      string `db:"group_id"`
	TargetTopic  string `db:"target_topic"`
	Partition    int32  `db:"partition"`
	OldestOffset int64  `db:"oldest_offset"`
}

func (r *InflightPartitionsRow) dest() []any {
	return []any{&r.GroupID, &r.TargetTopic, &r.Partition, &r.OldestOffset}
}

// InflightPartitions lists the partitions, by group, that the release must
// ask committed offsets for (inflight_partitions.sql).
func InflightPartitions(ctx context.Context, db DBTX) ([]InflightPartitionsRow, error) {
	return collect(ctx, db, inflightPartitionsSQL, NoParams{}.args(), (*InflightPartitionsRow).dest)
}

// InflightReleaseParams are inflight_release.sql's parameters, one element
// per group and partition, all four parallel.
type InflightReleaseParams struct {
	Groups     []string // $1
	Topics     []string // $2
	Partitions []int32  // $3
	Committed  []int64  // $4: the next offset the group will read there
}

func (p InflightReleaseParams) args() []any {
	return []any{p.Groups, p.Topics, p.Partitions, p.Committed}
}

// InflightReleaseRow counts the in-flight rows released.
type InflightReleaseRow struct {
	Released int64 `db:"released"`
}

func (r *InflightReleaseRow) dest() []any { return []any{&r.Released} }

// InflightRelease deletes the in-flight rows below their group's committed
// offsets (inflight_release.sql).
func InflightRelease(ctx context.Context, db DBTX, p InflightReleaseParams) (InflightReleaseRow, error) {
	return one(ctx, db, inflightReleaseSQL, p.args(), (*InflightReleaseRow).dest)
}
