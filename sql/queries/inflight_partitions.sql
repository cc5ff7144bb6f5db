-- The release's work list: each consumer group, target topic and partition
-- deferred_inflight holds keys for, with the lowest record offset held
-- there. The release asks each group for the committed offsets of just
-- these partitions, and sends the delete only for partitions whose
-- committed offset passed that lowest record, so that a tick with nothing
-- to release writes nothing. One pass over deferred_inflight_partition, in
-- its order: the table holds only records republished and not yet committed
-- past, which groups commit within seconds.
SELECT group_id, target_topic, partition, min(record_offset) AS oldest_offset
FROM deferred_inflight
GROUP BY group_id, target_topic, partition
ORDER BY group_id, target_topic, partition
